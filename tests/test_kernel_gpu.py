"""CUDA swap-in kernels against the torch reference, byte for byte (needs a GPU).

Every test draws fresh random inputs (the seed is in each failure message;
set HISPARSE_TEST_SEED to replay one). For each step the kernel's outputs,
the device pool (all of it, so stray writes show up), the slot tables, the
LRU order and the miss plan must equal the reference run on CPU copies, and
every selected token's device row must hold its host bytes.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernel_cases import (
    SwapInCase, check_rows_served, graph_case, make_case, make_residency, refresh_top_k,
)
from sglang_hisparse import kernels
from sglang_hisparse.kernels import bench
from sglang_hisparse.kernels import copy_planned as copy_mod
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels import swap_in as swap_mod

pytestmark = pytest.mark.gpu

PAGE = 64


def _seed() -> int:
    fixed = os.environ.get("HISPARSE_TEST_SEED")
    return int(fixed) if fixed else random.SystemRandom().randrange(1 << 30)


def _plan(bs: int, top_k: int, device) -> dict:
    return dict(
        miss_src=torch.full((bs, top_k), -5, dtype=torch.int64, device=device),
        miss_dst=torch.full((bs, top_k), -5, dtype=torch.int32, device=device),
        miss_count=torch.full((bs,), -5, dtype=torch.int32, device=device),
    )


def _compare(tag: str, gpu: SwapInCase, want: SwapInCase, gplan=None, wplan=None,
             rows_served: bool = True) -> None:
    torch.cuda.synchronize()
    for name in ("out", "slot_tokens", "lru"):
        got, exp = getattr(gpu, name).cpu(), getattr(want, name)
        if not torch.equal(got, exp):
            diff = (got != exp).nonzero()
            raise AssertionError(
                f"{tag}: {name} differs at {diff.shape[0]} places, first {diff[:4].tolist()}: "
                f"got {[got[tuple(i)].item() for i in diff[:4]]}, "
                f"want {[exp[tuple(i)].item() for i in diff[:4]]}"
            )
    kv = gpu.device_kv.cpu()
    if not torch.equal(kv, want.device_kv):
        rows = (kv != want.device_kv).any(1).nonzero().squeeze(1)
        raise AssertionError(f"{tag}: device_kv differs in {rows.numel()} rows, first {rows[:8].tolist()}")
    if gplan is not None:
        count = gplan["miss_count"].cpu()
        assert torch.equal(count, wplan["miss_count"]), f"{tag}: miss_count {count} vs {wplan['miss_count']}"
        for b, n in enumerate(count.tolist()):
            for key in ("miss_src", "miss_dst"):
                got, exp = gplan[key][b, :n].cpu(), wplan[key][b, :n]
                assert torch.equal(got, exp), f"{tag}: {key}[{b}, :{n}] differs"
    if rows_served:  # with skip_io the slots are assigned but never filled
        check_rows_served(gpu)


def _step(tag, gpu: SwapInCase, want: SwapInCase, plan: bool = True, **kw):
    bs, top_k = want.top_k_tokens.shape
    gplan = _plan(bs, top_k, "cuda") if plan else {}
    wplan = {k: v.cpu() for k, v in gplan.items()}
    tally = torch.full((2,), 7, dtype=torch.int64, device="cuda")
    want_tally = tally.cpu()
    # the probe and hash-scale overrides are benchmark-only (kernels.bench)
    launch = bench.swap_in_bench if {"probe", "hash_scale"} & set(kw) else swap_mod.swap_in
    launch(*gpu.args(), layout=gpu.layout, **gplan, tally=tally, **kw)
    ref.swap_in(*want.args(), layout=want.layout, **wplan, tally=want_tally,
                skip_io=kw.get("skip_io", False))
    _compare(tag, gpu, want, gplan or None, wplan or None,
             rows_served=not kw.get("skip_io", False))
    assert torch.equal(tally.cpu(), want_tally), f"{tag}: tally {tally.tolist()} vs {want_tally.tolist()}"


def _seq_lens(bs: int, hot: int, offset: int, gen: random.Random) -> list[int]:
    """Shorter than, equal to, just over and far longer than the buffer."""
    kinds = [
        lambda: gen.randrange(1, hot),
        lambda: hot,
        lambda: hot + 1 + gen.randrange(0, 3),
        lambda: hot * gen.choice((4, 8)) + gen.randrange(0, hot),
    ]
    return [kinds[(b + offset) % 4]() for b in range(bs)]


def _item_bytes(bs: int, top_k: int, hot: int) -> int:
    # Production row sizes when the pools stay small, odd sizes otherwise
    # (pinned host rows grow with bs x hot). Fixed per (top_k, hot) so the
    # sweep builds at most two kernel variants per shape, yet every size
    # appears across the shapes.
    shape = top_k.bit_length() * 2 + hot // top_k
    if bs * hot <= 64 * 1024:
        return (1152, 656)[shape % 2]
    return (80, 72, 100)[shape % 3]


@pytest.mark.parametrize("mult", [1, 2, 4])
@pytest.mark.parametrize("top_k", [64, 512, 2048])
@pytest.mark.parametrize("bs", [1, 5, 17, 64])
def test_matches_reference(bs, top_k, mult):
    seed = _seed()
    gen = random.Random(seed)
    hot = top_k * mult
    offsets = range(4) if bs == 1 else range(1)
    for offset in offsets:
        lens = _seq_lens(bs, hot, offset + seed, gen)
        num_real = bs if gen.random() < 0.6 else gen.randrange(0, bs + 1)
        case = make_case(
            seq_lens=lens,
            top_k=top_k,
            hot=hot,
            page=PAGE,
            miss_rate=gen.random(),
            item_bytes=_item_bytes(bs, top_k, hot),
            num_real=num_real,
            seed=seed + offset,
            index_dtype=gen.choice((torch.int32, torch.int64)),
            req_dtype=gen.choice((torch.int32, torch.int64)),
            pad_top_k=gen.choice((0, 0, top_k // 8)),
            duplicates=gen.choice((0, 0, 3)),
            include_newest=gen.random() < 0.7,
            empty_slots=gen.choice((0, 0, min(5, hot - top_k))),
        )
        gpu, want = case.clone("cuda", pin_host=True), case.clone()
        tag = f"seed={seed} bs={bs} top_k={top_k} hot={hot} lens={lens[:4]} real={num_real}"
        for step in range(2):  # the second step starts from the kernel's own state
            _step(f"{tag} step={step}", gpu, want)
            refresh_top_k(want, seed=seed + 100 + step, miss_rate=gen.random())
            gpu.top_k_tokens.copy_(want.top_k_tokens)


@pytest.mark.parametrize("layout", ["rows", "dsv4_c4"])
def test_every_split_gives_the_same_answer(layout):
    """Blocks per request only change who copies what; also repeats the same
    input many times to flush out races between blocks of one request."""
    seed = _seed()
    base = make_case(
        seq_lens=[40000, 9000, 4096, 300], top_k=512, hot=1024, page=PAGE, miss_rate=0.6,
        item_bytes=1152, seed=seed, layout=layout, duplicates=2, pad_top_k=7,
    )
    want = base.clone()
    ref.swap_in(*want.args(), layout=layout)
    for split in (1, 2, 3, 7, 32, 200):
        for rep in range(3 if split > 1 else 1):
            gpu = base.clone("cuda", pin_host=True)
            swap_mod.swap_in(*gpu.args(), layout=layout, blocks_per_req=split)
            _compare(f"seed={seed} layout={layout} split={split} rep={rep}", gpu, want)


def test_repeated_runs_are_identical():
    seed = _seed()
    base = make_case(seq_lens=[70000] * 3, top_k=2048, hot=4096, page=PAGE, miss_rate=0.5,
                     item_bytes=1152, seed=seed)
    want = base.clone()
    ref.swap_in(*want.args())
    for rep in range(20):
        gpu = base.clone("cuda", pin_host=True)
        swap_mod.swap_in(*gpu.args())
        _compare(f"seed={seed} rep={rep}", gpu, want)


@pytest.mark.parametrize("block_size", [64, 960, 1024])
def test_block_size_override(block_size):
    seed = _seed()
    case = make_case(seq_lens=[5000, 100, 3000], top_k=256, hot=512, page=PAGE, miss_rate=0.4,
                     item_bytes=656, seed=seed, duplicates=1)
    gpu, want = case.clone("cuda", pin_host=True), case.clone()
    _step(f"seed={seed} block_size={block_size}", gpu, want, block_size=block_size)


def test_probe_stamps_phases_without_changing_the_result():
    """The benchmark's timing probe: ordered stamps, the grid span around
    block (0, 0)'s, and the same outputs and state as a call without it."""
    seed = _seed()
    case = make_case(seq_lens=[9000, 7000, 300], top_k=512, hot=1024, page=PAGE, miss_rate=0.5,
                     item_bytes=1152, seed=seed)
    gpu, want = case.clone("cuda", pin_host=True), case.clone()
    probe = kernels.new_probe("cuda")
    _step(f"seed={seed}", gpu, want, plan=False, probe=probe)
    stamps = probe.cpu().tolist()
    phases = [t for t in stamps[: len(kernels.PROBE_PHASES)] if t]
    assert phases == sorted(phases) and len(phases) == len(kernels.PROBE_PHASES), stamps
    got = kernels.probe_phases_us(probe)
    # %globaltimer is per SM: block (0, 0)'s entry may read a few tens of ns
    # before the grid's earliest entry stamp of another SM.
    assert got["grid_span"] >= got["block0_total"] >= 0 and got["block0_start_lag"] >= -1.0


def test_skip_io_updates_state_only():
    seed = _seed()
    case = make_case(seq_lens=[9000, 7000], top_k=512, hot=1024, page=PAGE, miss_rate=0.9,
                     item_bytes=1152, seed=seed)
    gpu, want = case.clone("cuda", pin_host=True), case.clone()
    kv_before = gpu.device_kv.clone()
    _step(f"seed={seed}", gpu, want, skip_io=True)
    assert torch.equal(gpu.device_kv, kv_before)


def test_strided_pools_and_host_on_device():
    """Row strides wider than the row (views into wider pools) and a host
    pool that lives in device memory."""
    seed = _seed()
    case = make_case(seq_lens=[6000, 50, 4000], top_k=512, hot=1024, page=PAGE, miss_rate=0.5,
                     item_bytes=656, seed=seed)
    want = case.clone()
    ref.swap_in(*want.args())
    gpu = case.clone("cuda")
    wide_host = torch.zeros((case.host_kv.size(0), 656 + 48), dtype=torch.uint8).pin_memory()
    wide_host[:, :656] = case.host_kv
    wide_dev = torch.zeros((case.device_kv.size(0), 656 + 16), dtype=torch.uint8, device="cuda")
    wide_dev[:, :656] = gpu.device_kv
    gpu.host_kv, gpu.device_kv = wide_host[:, :656], wide_dev[:, :656]
    swap_mod.swap_in(*gpu.args())
    gpu.host_kv = case.host_kv
    _compare(f"seed={seed} strided", gpu, want)
    assert torch.count_nonzero(wide_dev[:, 656:]) == 0, "wrote past the row"

    gpu = case.clone("cuda")
    gpu.host_kv = case.host_kv.cuda()
    swap_mod.swap_in(*gpu.args())
    gpu.host_kv = case.host_kv
    _compare(f"seed={seed} host-on-device", gpu, want)


@pytest.mark.parametrize("layout", ["rows", "dsv4_c4"])
def test_copy_planned_replays_the_plan(layout):
    seed = _seed()
    case = make_case(seq_lens=[20000, 10, 5000, 3000], top_k=512, hot=1024, page=PAGE,
                     miss_rate=0.7, item_bytes=1152, seed=seed, layout=layout)
    fresh_host = case.host_kv.clone().pin_memory()
    fresh_dev = case.device_kv.cuda()
    gpu = case.clone("cuda", pin_host=True)
    plan = _plan(4, 512, "cuda")
    swap_mod.swap_in(*gpu.args(), layout=layout, **plan)
    # another layer: same rows, its own pools
    for threads in copy_mod.COPY_THREADS:
        for num_blocks in (None, 1, 5):
            dev = fresh_dev.clone()
            copy_mod.copy_planned(**plan, num_real_reqs=gpu.num_real_reqs, host_kv=fresh_host,
                                 device_kv=dev, layout=layout, num_blocks=num_blocks, threads=threads)
            torch.cuda.synchronize()
            assert torch.equal(dev, gpu.device_kv), \
                f"seed={seed} layout={layout} num_blocks={num_blocks} threads={threads}"
    # padded rows are not replayed
    dev = fresh_dev.clone()
    real = torch.tensor([0], dtype=torch.int32, device="cuda")
    for threads in copy_mod.COPY_THREADS:
        copy_mod.copy_planned(**plan, num_real_reqs=real, host_kv=fresh_host, device_kv=dev,
                              layout=layout, threads=threads)
    torch.cuda.synchronize()
    assert torch.equal(dev, fresh_dev)
    with pytest.raises(ValueError, match="threads: must be one of 512, 32, got 64"):
        copy_mod.copy_planned(**plan, num_real_reqs=real, host_kv=fresh_host, device_kv=dev,
                              layout=layout, threads=64)


def test_cuda_graph_replay_with_changing_real_requests():
    seed = _seed()
    gen = random.Random(seed)
    bs, top_k = 8, 512
    case = graph_case(seed, top_k=top_k)
    want = case.clone()
    gpu = case.clone("cuda", pin_host=True)
    gplan = _plan(bs, top_k, "cuda")

    # warm up (build, the stream's arrival workspace, smem opt-in) on throwaway
    # copies of the state, on the capture stream, as SGLang's graph runner does
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    scratch = case.clone("cuda", pin_host=True)
    with torch.cuda.stream(capture):
        swap_mod.swap_in(*scratch.args(), **_plan(bs, top_k, "cuda"))
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        swap_mod.swap_in(*gpu.args(), **gplan)

    for step, real in enumerate([8, 3, 0, 5, 8, 1]):
        refresh_top_k(want, seed=seed + 7 * step, miss_rate=gen.random())
        want.num_real_reqs.fill_(real)
        # padding rows carry garbage the kernel must ignore
        want.top_k_tokens[real:] = torch.randint(-1, 9000, (bs - real, top_k), dtype=torch.int32)
        gpu.top_k_tokens.copy_(want.top_k_tokens)
        gpu.num_real_reqs.fill_(real)
        wplan = {k: v.cpu().clone() for k, v in gplan.items()}
        graph.replay()
        ref.swap_in(*want.args(), **wplan)
        _compare(f"seed={seed} graph step={step} real={real}", gpu, want, gplan, wplan)


def test_selected_dispatches_to_cuda():
    seed = _seed()
    case = make_case(seq_lens=[3000, 20], top_k=64, hot=128, page=PAGE, seed=seed)
    gpu, want = case.clone("cuda", pin_host=True), case.clone()
    kernels.swap_in_selected(*gpu.args())
    ref.swap_in(*want.args())
    _compare(f"seed={seed}", gpu, want)


@pytest.mark.parametrize("top_k,hot", [(64, 128), (2048, 4096)])
def test_resident_requests_translate_and_others_resolve(top_k, hot):
    seed = _seed()
    lens = [hot * 3, hot // 2, hot * 5 + 7, hot + 1, hot * 2]
    case = make_case(seq_lens=lens, top_k=top_k, hot=hot, page=PAGE, miss_rate=0.5,
                     item_bytes=1152, seed=seed, num_real=4)
    want, gpu = case.clone(), case.clone("cuda", pin_host=True)
    gplan = _plan(len(lens), top_k, "cuda")
    wplan = {k: v.cpu() for k, v in gplan.items()}
    res = make_residency(case, seed)  # about half the request slots resident
    swap_mod.swap_in(*gpu.args(), **gplan, **{k: v.cuda() for k, v in res.items()})
    ref.swap_in(*want.args(), **wplan, **res)
    _compare(f"seed={seed}", gpu, want, gplan, wplan, rows_served=False)


def test_streams_get_their_own_arrival_workspace():
    dev = torch.device("cuda")
    main = swap_mod.arrivals_workspace(dev, 8)
    assert swap_mod.arrivals_workspace(dev, 8) is main
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = swap_mod.arrivals_workspace(dev, 8)
        assert swap_mod.arrivals_workspace(dev, 8) is other
    assert other.data_ptr() != main.data_ptr()
    torch.cuda.synchronize()
    assert int(main.count_nonzero()) == int(other.count_nonzero()) == 0


def test_concurrent_swap_ins_on_two_streams():
    """Two requests' swap-ins, several blocks each, racing on two streams: each
    stream's last block commits its own slot tables (shared arrival counters
    would let one launch's blocks count toward the other's)."""
    seed = _seed()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cases = [make_case(seq_lens=[40000, 30000, 9000], top_k=512, hot=1024, page=PAGE,
                       miss_rate=0.6, item_bytes=1152, seed=seed + i) for i in range(2)]
    for rep in range(5):
        gpus = [c.clone("cuda", pin_host=True) for c in cases]
        wants = [c.clone() for c in cases]
        torch.cuda.synchronize()
        for s, g in zip(streams, gpus):
            with torch.cuda.stream(s):
                swap_mod.swap_in(*g.args(), blocks_per_req=16)
        for w in wants:
            ref.swap_in(*w.args())
        torch.cuda.synchronize()
        for i, (g, w) in enumerate(zip(gpus, wants)):
            _compare(f"seed={seed} rep={rep} stream={i}", g, w)


def test_capture_on_a_stream_without_a_workspace_is_refused_clearly():
    seed = _seed()
    case = make_case(seq_lens=[9000, 7000], top_k=512, hot=1024, page=PAGE, seed=seed)
    gpu = case.clone("cuda", pin_host=True)
    swap_mod.swap_in(*case.clone("cuda", pin_host=True).args(), blocks_per_req=4)  # eager: cached checks
    torch.cuda.synchronize()
    fresh = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="arrival workspace .* being captured"):
        with torch.cuda.graph(graph, stream=fresh):
            swap_mod.swap_in(*gpu.args(), blocks_per_req=4)


def test_cached_checks_still_refuse_an_unpinned_host_pool():
    """The first call checks everything and later calls with the same
    geometries reuse the verdict; a different host pool is checked again."""
    seed = _seed()
    case = make_case(seq_lens=[5000, 20], top_k=64, hot=128, page=PAGE, seed=seed)
    gpu, want = case.clone("cuda", pin_host=True), case.clone()
    swap_mod.swap_in(*gpu.args())
    ref.swap_in(*want.args())
    _compare(f"seed={seed} first", gpu, want)
    refresh_top_k(want, seed=seed + 1)
    gpu.top_k_tokens.copy_(want.top_k_tokens)
    swap_mod.swap_in(*gpu.args())  # the cached verdict
    ref.swap_in(*want.args())
    _compare(f"seed={seed} cached", gpu, want)
    gpu.host_kv = case.host_kv.clone()  # not pinned
    with pytest.raises(ValueError, match="host_kv: CPU tensor must be pinned"):
        swap_mod.swap_in(*gpu.args())


# --------------------------------------------------------------------------
# speculative verify: draft_tokens rows per request, one union (MTP/EAGLE)


def _verify_step(tag, gpu: SwapInCase, want: SwapInCase, **kw) -> None:
    n = want.draft_tokens
    bs, top_k = want.req_pool_indices.numel(), want.top_k_tokens.size(1)
    gplan = _plan(bs, n * top_k, "cuda")
    wplan = {k: v.cpu() for k, v in gplan.items()}
    tally = torch.zeros((2,), dtype=torch.int64, device="cuda")
    want_tally = tally.cpu()
    swap_mod.swap_in(*gpu.args(), layout=gpu.layout, **gplan, tally=tally, draft_tokens=n, **kw)
    ref.swap_in(*want.args(), layout=want.layout, **wplan, tally=want_tally, draft_tokens=n)
    _compare(tag, gpu, want, gplan, wplan)
    assert torch.equal(tally.cpu(), want_tally), f"{tag}: tally {tally.tolist()} vs {want_tally.tolist()}"


@pytest.mark.parametrize("ndt", [2, 4])
@pytest.mark.parametrize("top_k,extra", [(64, 0), (512, 64), (2048, 64)])
@pytest.mark.parametrize("bs", [1, 7, 32])
def test_verify_matches_reference(bs, top_k, extra, ndt):
    """Short, crossing the buffer, at it and far past it; B = ndt x top_k (+ extra)."""
    from kernel_cases import make_verify_case

    seed = _seed()
    gen = random.Random(seed)
    hot = ndt * top_k + extra
    kinds = [lambda: gen.randrange(1, hot - ndt), lambda: hot - 1, lambda: hot,
             lambda: hot * gen.choice((3, 6)) + gen.randrange(0, hot)]
    committed = [kinds[(b + seed) % 4]() for b in range(bs)]
    num_real = bs if gen.random() < 0.6 else gen.randrange(0, bs + 1)
    case = make_verify_case(
        committed=committed, draft_tokens=ndt, top_k=top_k, hot=hot, page=PAGE,
        miss_rate=gen.random(), item_bytes=656, num_real=num_real, seed=seed,
        overlap=gen.random(), pad_top_k=gen.choice((0, top_k // 8)),
        index_dtype=gen.choice((torch.int32, torch.int64)),
        req_dtype=gen.choice((torch.int32, torch.int64)))
    gpu, want = case.clone("cuda", pin_host=True), case.clone()
    _verify_step(f"seed={seed} bs={bs} top_k={top_k} ndt={ndt} committed={committed[:4]}",
                 gpu, want)


def test_verify_under_cuda_graph_replay():
    from kernel_cases import make_verify_case

    seed = _seed()
    gen = random.Random(seed)
    ndt, top_k, bs = 3, 256, 6
    hot = ndt * top_k + 64
    case = make_verify_case(committed=[hot * 5, 40, hot, hot * 2 + 7, hot - 2, 9000],
                            draft_tokens=ndt, top_k=top_k, hot=hot, page=PAGE, miss_rate=0.5,
                            item_bytes=1152, seed=seed, index_dtype=torch.int32,
                            req_dtype=torch.int32)
    want, gpu = case.clone(), case.clone("cuda", pin_host=True)
    gplan = _plan(bs, ndt * top_k, "cuda")
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    scratch = case.clone("cuda", pin_host=True)
    with torch.cuda.stream(capture):
        swap_mod.swap_in(*scratch.args(), **_plan(bs, ndt * top_k, "cuda"), draft_tokens=ndt)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        swap_mod.swap_in(*gpu.args(), **gplan, draft_tokens=ndt)
    for step, real in enumerate([6, 2, 0, 6, 4]):
        fresh = make_verify_case(committed=[hot * 5, 40, hot, hot * 2 + 7, hot - 2, 9000],
                                 draft_tokens=ndt, top_k=top_k, hot=hot, page=PAGE,
                                 miss_rate=gen.random(), item_bytes=1152, seed=seed + step + 1)
        want.top_k_tokens.copy_(fresh.top_k_tokens)
        want.num_real_reqs.fill_(real)
        gpu.top_k_tokens.copy_(want.top_k_tokens)
        gpu.num_real_reqs.fill_(real)
        wplan = {k: v.cpu().clone() for k, v in gplan.items()}
        graph.replay()
        ref.swap_in(*want.args(), **wplan, draft_tokens=ndt)
        _compare(f"seed={seed} verify graph step={step} real={real}", gpu, want, gplan, wplan,
                 rows_served=False)
