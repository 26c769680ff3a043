"""Host pools on CPU: page-granular allocation, row layouts, copies, teardown."""

import pytest
import torch

from dataplane_fixtures import PS, dsa_pool, req_pool
from sglang_hisparse.pools.host import (
    C4_SCALE_BYTES, C4_VALUE_BYTES, HiSparseC4HostPool, HiSparseMLAHostPool, HostPoolExhausted,
    c4_page_bytes,
)


@pytest.fixture
def pool():
    return dsa_pool(512)


def test_mla_row_bytes_bf16_and_fp8(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    assert host.item_bytes == 1152 and host.layer_rows(0).shape == (host.size, 1152)
    assert host.size % PS == 0 and host.size > 2 * 512
    assert not host.pin_memory  # CPU device pool: nothing to pin
    fp8 = dsa_pool(512, dtype=torch.float8_e4m3fn, kv_cache_dim=656)
    h8 = HiSparseMLAHostPool(fp8, host_to_device_ratio=2, page_size=PS)
    assert h8.item_bytes == 656


def test_built_on_hicache_mla_host_pool(pool):
    from sglang.srt.mem_cache.memory_pool_host import HostKVCache

    from sglang_hisparse.adapter.releases import current

    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    # (0.5.17 moved the MLA host pool to mem_cache/pool_host/mla.py)
    assert isinstance(host, current.mla_host_pool_class()) and isinstance(host, HostKVCache)


def test_paged_token_slots_grow_by_page_and_release(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    r2t = req_pool()
    table = torch.full((8, 1024 + PS), -1, dtype=torch.int64)
    lens = torch.zeros(8, dtype=torch.int64)
    total = host.available_size()
    rows = host.try_alloc_paged_token_slots(table, lens, 3, 0, 100)
    assert rows.numel() == 100 and int(lens[3]) == 128
    assert host.available_size() == total - 128
    assert rows[:64].tolist() == list(range(int(rows[0]), int(rows[0]) + 64))
    one = host.try_alloc_paged_token_slots(table, lens, 3, 100, 1)  # inside the page
    assert host.available_size() == total - 128 and int(one[0]) == int(table[3, 100])
    host.try_alloc_paged_token_slots(table, lens, 3, 128, 1)  # next page
    assert host.available_size() == total - 192
    assert host.allocated_host_indices(table, 3, lens[3]).numel() == 192
    assert host.release_request_rows(table, lens, 3) == 3
    assert host.available_size() == total and int(lens[3]) == 0 and bool((table[3] == -1).all())


def test_exhausted_pool_returns_none_then_raises_on_strict_api(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    table = torch.full((2, 4096), -1, dtype=torch.int64)
    lens = torch.zeros(2, dtype=torch.int64)
    grab = host.alloc_page(host.free_page_count() - 1)
    assert host.try_alloc_paged_token_slots(table, lens, 0, 0, 2 * PS) is None
    assert int(lens[0]) == 0 and bool((table[0] == -1).all())  # nothing half-done
    with pytest.raises(HostPoolExhausted):
        host.alloc_paged_token_slots(table, lens, 0, 0, 2 * PS)
    host.free(grab)
    assert host.try_alloc_paged_token_slots(table, lens, 0, 0, 2 * PS) is not None


def test_double_free_detected(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    rows = host.alloc_page(1)
    host.free(rows)
    with pytest.raises(RuntimeError, match="double free"):
        host.free(rows)


def test_cpu_backup_and_load_roundtrip(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    dev_rows = torch.tensor([70, 71, 200], dtype=torch.int64)
    host_rows = torch.tensor([5, 900, 64], dtype=torch.int64)
    for layer in range(pool.layer_num):
        pool.kv_buffer[layer][dev_rows] = torch.randn(3, 1, 576).to(torch.bfloat16)
    host.backup_from_device_all_layer(pool, host_rows, dev_rows, io_backend="kernel")
    for layer in range(pool.layer_num):
        assert torch.equal(host.kv_buffer[layer][host_rows], pool.kv_buffer[layer][dev_rows])
    back = torch.tensor([300, 301, 302], dtype=torch.int64)
    host.load_to_device_per_layer(pool, host_rows, back, 1, io_backend="kernel")
    assert torch.equal(pool.kv_buffer[1][back], pool.kv_buffer[1][dev_rows])


def test_destroy_releases_each_buffer_once(pool, monkeypatch):
    from sglang_hisparse.pools import host_memory

    released = []
    monkeypatch.setattr(host_memory, "release", lambda buf: released.append(buf.data_ptr()))
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    c4 = HiSparseC4HostPool([torch.zeros(2, c4_page_bytes(), dtype=torch.uint8)] * 3,
                            num_host_pages=4)
    host.destroy()
    assert released == [host.kv_buffer.data_ptr()]
    host.destroy()  # idempotent: nothing released twice
    assert released == [host.kv_buffer.data_ptr()]
    released.clear()
    c4.destroy()
    c4.destroy()
    assert released == [b.data_ptr() for b in c4.kv_buffer] and len(set(released)) == 3


def test_c4_layout_and_token_copies():
    pages = 4
    page_bytes = c4_page_bytes()
    assert page_bytes % C4_VALUE_BYTES == 0 and page_bytes >= PS * (C4_VALUE_BYTES + C4_SCALE_BYTES)
    dev = [torch.randint(0, 255, (pages, page_bytes), dtype=torch.uint8) for _ in range(2)]
    host = HiSparseC4HostPool(dev, num_host_pages=8)
    assert host.size == 8 * PS and host.kv_buffer[0].shape == (8, page_bytes)
    src = torch.tensor([3, 64 + 17], dtype=torch.int64)
    dst = torch.tensor([130, 5], dtype=torch.int64)
    host.backup_from_device_all_layer(None, dst, src)
    for layer in range(2):
        for s, d in zip(src.tolist(), dst.tolist()):
            sp, so = divmod(s, PS)
            dp, do = divmod(d, PS)
            v = slice(so * C4_VALUE_BYTES, (so + 1) * C4_VALUE_BYTES)
            vd = slice(do * C4_VALUE_BYTES, (do + 1) * C4_VALUE_BYTES)
            assert torch.equal(host.kv_buffer[layer][dp, vd], dev[layer][sp, v])
            sc = PS * C4_VALUE_BYTES
            assert torch.equal(
                host.kv_buffer[layer][dp, sc + do * 8 : sc + do * 8 + 8],
                dev[layer][sp, sc + so * 8 : sc + so * 8 + 8],
            )
    # load back into other device slots of one layer
    host.load_to_device_per_layer(None, dst, torch.tensor([200, 201]), 0)
    rows = host.alloc_page(2)
    assert rows.numel() == 2 * PS
    host.free(rows)
    assert host.available_size() == 8 * PS
    host.destroy()


def test_c4_matches_kernel_reference_layout():
    from sglang_hisparse.kernels import reference

    assert c4_page_bytes() == reference.C4_PAGE_BYTES
    dev = [torch.randint(0, 255, (2, c4_page_bytes()), dtype=torch.uint8)]
    host = HiSparseC4HostPool(dev, num_host_pages=2)
    host.backup_from_device_all_layer(None, torch.tensor([70]), torch.tensor([9]))
    got = reference.read_rows(host.kv_buffer[0], torch.tensor([70]), layout="c4")
    want = reference.read_rows(dev[0], torch.tensor([9]), layout="c4")
    assert torch.equal(got, want)



def test_c4_gpu_path_builds_its_pointer_arrays_once(monkeypatch):
    # The GPU path hands SGLang's copy kernel per-layer base addresses. They
    # are built at the first copy and reused, so steady-state write-through
    # does no host-to-device copy for them. On CPU the kernel is stood in
    # for by a copy that resolves the addresses back to the buffers, which
    # also checks that each direction and layer gets the right arrays.
    from sglang_hisparse.adapter import releases

    jit_hisparse = releases.current.hisparse_ops()
    from sglang_hisparse.kernels import reference

    dev = [torch.randint(0, 255, (3, c4_page_bytes()), dtype=torch.uint8) for _ in range(3)]
    host = HiSparseC4HostPool(dev, num_host_pages=4)
    by_ptr = {b.data_ptr(): b for b in dev + host.kv_buffer}
    seen = []

    def kernel(src_ptrs, dst_ptrs, src_indices, dst_indices):
        seen.append((src_ptrs, dst_ptrs))
        for s, d in zip(src_ptrs.tolist(), dst_ptrs.tolist()):
            host._copy_tokens(by_ptr[s], by_ptr[d], src_indices, dst_indices)

    monkeypatch.setattr(jit_hisparse, "transfer_cache_dsv4_mla", kernel)
    monkeypatch.setattr(host, "_gpu", lambda *t: True)
    src, dst = torch.tensor([3, 81]), torch.tensor([130, 5])
    host.backup_from_device_all_layer(None, dst, src)
    first = host._ptrs
    for _ in range(2):
        host.backup_from_device_all_layer(None, dst, src)
    back = torch.tensor([150, 151])
    host.load_to_device_per_layer(None, dst, back, 2)
    assert host._ptrs is first  # not rebuilt
    device_ptrs, host_ptrs = first
    assert device_ptrs.tolist() == [b.data_ptr() for b in dev]
    assert host_ptrs.tolist() == [b.data_ptr() for b in host.kv_buffer]
    assert len(seen) == 4 and all(s is device_ptrs and d is host_ptrs for s, d in seen[:3])
    assert seen[3][0].tolist() == host_ptrs[2:3].tolist()
    assert seen[3][1].tolist() == device_ptrs[2:3].tolist()
    for layer in range(3):
        assert torch.equal(reference.read_rows(host.kv_buffer[layer], dst, layout="c4"),
                           reference.read_rows(dev[layer], src, layout="c4"))
    assert torch.equal(reference.read_rows(dev[2], back, layout="c4"),
                       reference.read_rows(dev[2], src, layout="c4"))
    assert not torch.equal(reference.read_rows(dev[1], back, layout="c4"),
                           reference.read_rows(dev[1], src, layout="c4"))  # one layer only
