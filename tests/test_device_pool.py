"""HiSparseDSADevicePool on CPU with the real SGLang base pool, our allocator
and our coordinator (Triton KV write/read kernels interpreted on CPU).

The pool must be indistinguishable from 0.5.13's HiSparseDSATokenToKVPool for
the attention backend: same buffers, same translation (including -1 padding),
KV written through logical locations landing in the mapped physical rows.
"""

import inspect
import json
import weakref

import pytest
import torch

from conftest import run_python
from dataplane_fixtures import (
    PS, get_tag, kv_allocated_len, make_req, prefill, req_pool, set_kv_allocated_len, t64,
)
from sglang_hisparse.pools.allocator import HiSparseDualAllocator
from sglang_hisparse.adapter.model_runner import HiSparseCoordinator
from sglang_hisparse.pools.device_dsa import HiSparseDSADevicePool

PHYS, RATIO, LAYERS = 1024, 2, 2
TARGET = "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool"


def make_pool(cls=HiSparseDSADevicePool, size=PHYS, ratio=RATIO, dtype=torch.bfloat16,
              kv_cache_dim=576):
    # Called the way model_runner_kv_cache_mixin.py:565 does: size positional,
    # the rest by keyword.
    return cls(
        size, page_size=PS, dtype=dtype, kv_lora_rank=512, qk_rope_head_dim=64,
        layer_num=LAYERS, device="cpu", kv_cache_dim=kv_cache_dim,
        enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1,
        index_head_dim=128, host_to_device_ratio=ratio,
    )


def native_cls():
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool

    assert HiSparseDSATokenToKVPool is not HiSparseDSADevicePool, "plugin active in-process"
    return HiSparseDSATokenToKVPool


def layer(layer_id):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=1, head_dim=576, scaling=1.0, num_kv_heads=1,
                          layer_id=layer_id, v_head_dim=512)


def tagged_kv(toks, layer_id):
    """(nope, rope) whose rows carry token ids the way dataplane_fixtures.put_tag does."""
    toks = torch.as_tensor(toks, dtype=torch.int64)
    nope = torch.zeros(len(toks), 1, 512, dtype=torch.bfloat16)
    nope[:, 0, 0] = (toks % 128).to(torch.bfloat16)
    nope[:, 0, 1] = float(layer_id + 1)
    nope[:, 0, 2] = (toks // 128).to(torch.bfloat16)
    rope = torch.full((len(toks), 1, 64), float(layer_id + 1), dtype=torch.bfloat16)
    return nope, rope


@pytest.fixture
def setup():
    pool = make_pool()
    alloc = HiSparseDualAllocator(PHYS, PS, torch.bfloat16, "cpu", pool, False,
                                  host_to_device_ratio=RATIO)
    return pool, alloc, req_pool()


def shifted_prefill(alloc, r2t, n, rid="a"):
    """A prompt whose physical rows differ from its logical ids: two physical
    pages are taken first, the way the coordinator takes hot-buffer pages."""
    hold = alloc.hisparse_attn_allocator.alloc(2 * PS)
    assert hold is not None
    logical = prefill(r2t, alloc, make_req(rid, n), n)
    physical = alloc.translate_to_physical(logical)
    assert not torch.equal(logical, physical)
    return logical, physical


# ------------------------------------------------------------------ structure
def test_signature_matches_native():
    ours = inspect.signature(HiSparseDSADevicePool.__init__).parameters
    native = inspect.signature(native_cls().__init__).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in native.values()
    ]


def test_class_relations():
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool

    pool = make_pool()
    # disaggregation/utils.py:650, hiradix_cache.py, cache_controller.py test these
    assert isinstance(pool, DSATokenToKVPool) and isinstance(pool, MLATokenToKVPool)
    # no 0.5.13 code tests isinstance against the native class; we do not inherit it
    assert not isinstance(pool, native_cls())


@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 576), (torch.float8_e4m3fn, 656)])
def test_buffers_identical_to_native(dtype, dim):
    ours, native = make_pool(dtype=dtype, kv_cache_dim=dim), make_pool(native_cls(), dtype=dtype,
                                                                        kv_cache_dim=dim)
    for name in ("kv_buffer", "index_k_with_scale_buffer"):
        a, b = getattr(ours, name), getattr(native, name)
        assert [(t.shape, t.dtype) for t in a] == [(t.shape, t.dtype) for t in b], name
    for attr in ("size", "page_size", "kv_cache_dim", "store_dtype", "dtype", "layer_num",
                 "bytes_per_token", "dsa_kv_cache_store_fp8", "index_head_dim"):
        assert getattr(ours, attr) == getattr(native, attr), attr
    assert ours.data_ptrs.shape == native.data_ptrs.shape
    assert ours.get_kv_size_bytes() == native.get_kv_size_bytes()


def test_index_k_buffer_covers_logical_space(setup):
    pool, alloc, _ = setup
    # kv_buffer: physical rows only (plus the padding page)
    assert pool.kv_buffer[0].shape[0] == PHYS + PS
    # indexer cache: one page per logical page, incl. the padding page
    pages = pool.index_k_with_scale_buffer[0].shape[0]
    assert pages * PS >= alloc.size_full + PS
    assert (alloc.size_full + PS - 1) // PS < pages  # last logical slot's page exists
    assert pages * PS < (alloc.size_full + 2 * PS)  # and no more than that
    ratio3 = make_pool(ratio=3)
    assert ratio3.index_k_with_scale_buffer[0].shape[0] * PS >= 3 * PHYS + PS


def test_bad_ratio_rejected():
    with pytest.raises(ValueError, match="host_to_device_ratio"):
        make_pool(ratio=0)


# ---------------------------------------------------------------- translation
def test_mapping_registered_as_weak_proxy(setup):
    pool, alloc, r2t = setup
    mapping = pool.full_to_hisparse_device_index_mapping
    assert isinstance(mapping, weakref.ProxyType)
    logical, physical = shifted_prefill(alloc, r2t, 100)
    # the allocator's in-place updates are what the pool sees
    assert torch.equal(pool.translate_loc_to_hisparse_device(logical), physical)


def test_translate_keeps_minus_one_padding_like_native(setup):
    pool, alloc, r2t = setup
    logical, physical = shifted_prefill(alloc, r2t, 100)
    native = make_pool(native_cls())
    native.register_mapping(weakref.proxy(alloc.full_to_hisparse_device_index_mapping))
    # a top-k page table as dsa_backend.py:1507 passes it: int32, -1 padded
    table = torch.full((3, 16), -1, dtype=torch.int32)
    table[0, :5] = logical[[0, 7, 50, 98, 99]].to(torch.int32)
    table[1, :1] = logical[3].to(torch.int32)
    out = pool.translate_loc_to_hisparse_device(table)
    assert out.shape == table.shape and out.dtype == torch.int64
    assert out[0, :5].tolist() == physical[[0, 7, 50, 98, 99]].tolist()
    assert int(out[1, 0]) == int(physical[3])
    assert bool((out[0, 5:] == -1).all()) and bool((out[1, 1:] == -1).all())
    assert bool((out[2] == -1).all())
    assert torch.equal(out, native.translate_loc_to_hisparse_device(table))
    # the aliases 0.5.13's allocator/coordinator call
    for name in ("_translate_loc_to_hisparse_device",
                 "translate_loc_from_full_to_hisparse_device"):
        assert torch.equal(getattr(pool, name)(table), out)
    assert pool.translate_loc_from_full_to_compressed(logical) is logical
    # last_loc == -1 (request without prefix) through the allocator too
    assert alloc.get_last_loc_hisparse_device(t64(-1)).tolist() == [-1]


def test_translate_without_mapping_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no logical->physical mapping"):
        make_pool().translate_loc_to_hisparse_device(t64(1, 2))


# ----------------------------------------------------------- KV write / read
def test_set_mla_kv_buffer_lands_in_mapped_rows(setup):
    pool, alloc, r2t = setup
    logical, physical = shifted_prefill(alloc, r2t, 100)
    before = [buf.clone() for buf in pool.kv_buffer]
    for lid in range(LAYERS):
        pool.set_mla_kv_buffer(layer(lid), logical, *tagged_kv(range(100), lid))
    for lid in range(LAYERS):
        buf = pool.kv_buffer[lid]
        assert get_tag(buf, physical) == list(range(100))
        assert bool((buf[physical, 0, 1] == lid + 1).all())
        assert bool((buf[physical, 0, 512:] == lid + 1).all())
        # nothing else was touched (in particular not the rows named by the
        # logical ids themselves)
        untouched = torch.ones(buf.shape[0], dtype=torch.bool)
        untouched[physical] = False
        assert torch.equal(buf[untouched], before[lid][untouched])
        # reads translate the same way
        nope, rope = pool.get_mla_kv_buffer(layer(lid), logical)
        assert torch.equal(nope, buf[physical, :, :512])
        assert torch.equal(rope, buf[physical, :, 512:])
        nope32, _ = pool.get_mla_kv_buffer(layer(lid), logical, torch.float32)
        assert nope32.dtype == torch.float32


def test_set_kv_buffer_lands_in_mapped_rows(setup):
    pool, alloc, r2t = setup
    logical, physical = shifted_prefill(alloc, r2t, 70)
    k = torch.randn(70, 1, 576, dtype=torch.bfloat16)
    pool.set_kv_buffer(layer(1), logical, k, None)
    assert torch.equal(pool.kv_buffer[1][physical], k)
    assert int(pool.kv_buffer[0].abs().sum()) == 0


def test_writes_identical_to_native(setup):
    pool, alloc, r2t = setup
    logical, _ = shifted_prefill(alloc, r2t, 130)
    native = make_pool(native_cls())
    native.register_mapping(weakref.proxy(alloc.full_to_hisparse_device_index_mapping))
    torch.manual_seed(0)
    for lid in range(LAYERS):
        nope = torch.randn(130, 1, 512, dtype=torch.bfloat16)
        rope = torch.randn(130, 1, 64, dtype=torch.bfloat16)
        for p in (pool, native):
            p.set_mla_kv_buffer(layer(lid), logical, nope, rope)
        assert torch.equal(pool.kv_buffer[lid], native.kv_buffer[lid])
        for a, b in zip(pool.get_mla_kv_buffer(layer(lid), logical[::3]),
                        native.get_mla_kv_buffer(layer(lid), logical[::3])):
            assert torch.equal(a, b)


def test_transfer_values_on_device_has_no_pinned_caller():
    # 0.5.13's HiSparseDSATokenToKVPool defines transfer_values_on_device but
    # nothing calls it, so ours leaves it out. A release that starts calling
    # it must fail here rather than with an AttributeError in a server.
    import re

    from sglang_hisparse.pinned_source import installed_sglang_root

    root = installed_sglang_root() / "sglang"
    calls = [str(path.relative_to(root)) for path in root.rglob("*.py")
             if re.search(r"\.transfer_values_on_device\(", path.read_text(errors="replace"))]
    assert calls == [], calls
    assert not hasattr(HiSparseDSADevicePool, "transfer_values_on_device")
    assert hasattr(native_cls(), "transfer_values_on_device")  # the method we left out


def test_cpu_copy_refused(setup):
    pool, alloc, _ = setup
    with pytest.raises(NotImplementedError, match="host memory"):
        pool.get_cpu_copy(t64(1, 2))
    with pytest.raises(NotImplementedError, match="host pool"):
        pool.load_cpu_copy([], t64(1, 2), mamba_indices=None)
    # what retraction calls: served from the host pool on a PD decode node only
    with pytest.raises(NotImplementedError, match="only on a PD decode node"):
        alloc.get_cpu_copy(t64(1, 2), mamba_indices=None)
    with pytest.raises(NotImplementedError, match="only on a PD decode node"):
        alloc.load_cpu_copy(None, t64(1, 2), mamba_indices=None)


# ------------------------------------------------ with our coordinator (CPU)
def test_coordinator_round_trip_through_pool_writes():
    HOT, TOPK = 128, 16
    pool = make_pool()
    r2t = req_pool(8, 2048)
    alloc = HiSparseDualAllocator(PHYS, PS, torch.bfloat16, "cpu", pool, False, RATIO)
    coord = HiSparseCoordinator(r2t, alloc, TOPK, HOT, "cpu", None, RATIO, residency=False)
    assert coord.mem_pool_device is pool

    req = make_req("a", 300)
    logical = prefill(r2t, alloc, req, 300)
    for lid in range(LAYERS):  # the model's prefill KV write
        pool.set_mla_kv_buffer(layer(lid), logical, *tagged_kv(range(300), lid))
    coord.admit_request_into_staging(req)
    assert coord.collect_ready_reqs() == [req]
    idx = req.req_pool_idx
    host_rows = coord.req_to_host_pool[idx, :300]
    assert get_tag(coord.mem_pool_host.kv_buffer[1], host_rows) == list(range(300))

    # one decode step: allocate, map into the hot buffer, the model writes
    rpi, seq = t64(idx), t64(301)
    last = r2t.req_to_token[rpi, seq - 2].to(torch.int64)
    out = alloc.alloc_decode(seq, seq, last)
    r2t.req_to_token[rpi, seq - 1] = out.to(torch.int32)
    set_kv_allocated_len(req, kv_allocated_len(req) + 1)
    coord.map_last_loc_to_buffer(seq, out, rpi, seq.clone(), None)
    row = pool.translate_loc_to_hisparse_device(out)
    assert int(row) == int(coord.req_to_device_buffer[idx, HOT]) and int(row) != int(out)
    for lid in range(LAYERS):
        pool.set_mla_kv_buffer(layer(lid), out, *tagged_kv([300], lid))
        assert get_tag(pool.kv_buffer[lid], row) == [300]

    # swap-in, then the attention page table translated as dsa_backend does
    topk = torch.full((1, TOPK), -1, dtype=torch.int32)
    topk[0, :3] = torch.tensor([5, 250, 300], dtype=torch.int32)
    coord.num_real_reqs.fill_(1)
    rows = coord.swap_in_selected_pages(rpi, seq, topk, 0)
    assert get_tag(pool.kv_buffer[0], rows[0, :3]) == [5, 250, 300]
    assert bool((rows[0, 3:] == -1).all())


# ------------------------------------------------------------ installation
def test_replace_reaches_model_runner_binding():
    from releases import pool_builder_module

    code = f"""
        import json, os, importlib
        mixin = importlib.import_module({pool_builder_module()!r})  # builds the pool
        from sglang_hisparse.plugin import activate
        act = activate()
        from sglang_hisparse.pools.device_dsa import HiSparseDSADevicePool
        import sglang.srt.mem_cache.hisparse_memory_pool as hmp
        print(json.dumps(dict(
            applied=act.applied, error=act.error,
            mixin=mixin.HiSparseDSATokenToKVPool is HiSparseDSADevicePool,
            module=hmp.HiSparseDSATokenToKVPool is HiSparseDSADevicePool,
            name=mixin.HiSparseDSATokenToKVPool.__qualname__)))
    """
    for native, expect in (("0", True), ("1", False)):
        proc = run_python(code, env={"SGLANG_HISPARSE_NATIVE": native})
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["applied"], got["error"]
        assert got["mixin"] is expect and got["module"] is expect, got


def test_manifest_entry_checks_out():
    from sglang_hisparse.manifest import ENTRIES, Kind, Scope
    from sglang_hisparse.pinned_source import sglang_version
    from sglang_hisparse.plugin import check_entry

    (entry,) = [e for e in ENTRIES if e.target == TARGET]
    assert entry.kind is Kind.REPLACE and entry.scope is Scope.DATA_PLANE
    check = check_entry(entry, sglang_version())
    assert check.ok, check.detail
    assert check.hook is HiSparseDSADevicePool
