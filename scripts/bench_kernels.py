#!/usr/bin/env python3
"""Swap-in kernel benchmark: ours vs SGLang 0.5.13's (and optionally 0.5.23's).

One decode-step layer call per point: top_k 2048, hot buffer 4096 (+64
newest page), seq_len 32768, 1152-byte rows (DSA bf16 MLA), batch
{1, 8, 32, 64} x miss {0, 13, 40, 100}%. Each timed call starts from the
same slot tables (restored before it), with L2 flushed; 16 such rounds are
replayed from one CUDA graph (as in decode, where every layer's call sits in
one graph), minus the same rounds without the call, timed with CUDA events;
the median per call is shown.

Columns: ours, ours with the host copies skipped (resolve cost alone),
SGLang 0.5.13, SGLang 0.5.23 (with --upstream-0523 DIR), the bytes-moved
lower bound max(bytes / H2D ceiling, 10 us), where the ceiling is a large
pinned cudaMemcpyAsync measured in the same run, "gather": the copy-only
kernel replaying the miss plan ours recorded at that point (the same rows
moved by SM loads with nothing to resolve: what any kernel of this kind pays
for the bytes alone), and the ratios ours / bound (target <= 1.18),
ours / gather and ours / best upstream (target <= 1).

With --breakdown it then shows where our call's time goes at batch 1 and
64, 0% and 100% miss: the kernel's own phase stamps, one block per request,
other block sizes, and the two paths that resolve nothing (resident
requests, sequences shorter than the buffer). With --hash-scale 2,4,8 it
first times the resolve's hash table sizes against each other (buckets per
top-k entry), checking that each leaves the same state as the first.

Usage:
  python scripts/bench_kernels.py [--quick] [--json OUT] [--breakdown]
                                  [--upstream-0523 DIR] [--blocks-per-req N]
                                  [--hash-scale S,S,.. [--hash-scale-only]]
  python scripts/bench_kernels.py --verify [2,4]   # speculative verify rows only
  python scripts/bench_kernels.py --overlap [smx512,8x512,16x512@hi,..]  # prefetch replays beside compute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOP_K = 2048
HOT = 4096
PAGE = 64
SEQ = 32768
ITEM = 1152
HOST_ROWS = 1 << 18
FLUSH_BYTES = 256 << 20
MIN_BOUND_US = 10.0
TARGET_RATIO = 1.18


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------
# inputs


class World:
    """Pools sized for the largest batch; each point uses the first bs rows."""

    def __init__(self, max_bs: int, seed: int = 0, host_kv: torch.Tensor | None = None):
        """``host_kv``: a caller-pinned ``[rows, ITEM]`` uint8 buffer (default:
        HOST_ROWS random rows from torch's pinned allocator)."""
        gen = torch.Generator().manual_seed(seed)
        self.max_bs = max_bs
        width = HOT + PAGE
        if host_kv is None:
            host_kv = torch.randint(0, 256, (HOST_ROWS, ITEM), dtype=torch.uint8, generator=gen).pin_memory()
        host_rows = host_kv.shape[0]
        log(f"allocating: host pool {host_rows * ITEM / 2**20:.0f} MiB pinned, "
            f"device pool {max_bs * width * ITEM / 2**20:.0f} MiB")
        self.host_kv = host_kv
        self.device_kv = torch.empty((max_bs * width, ITEM), dtype=torch.uint8, device="cuda")
        self.slot_locs = torch.randperm(max_bs * width, generator=gen).to(torch.int32).reshape(max_bs, width).cuda()
        self.host_locs = torch.randint(0, host_rows, (max_bs, SEQ), generator=gen).cuda()
        # resident tokens: a random subset of the older positions; newest at slot HOT
        st = torch.full((max_bs, width), -1, dtype=torch.int32)
        self.resident, self.absent = [], []
        for r in range(max_bs):
            perm = torch.randperm(SEQ - 1, generator=gen)
            res, absent = perm[:HOT], perm[HOT:]
            st[r, :HOT] = res.to(torch.int32)
            st[r, HOT] = SEQ - 1
            self.resident.append(res)
            self.absent.append(absent)
        self.slot_tokens0 = st.cuda()
        self.lru0 = torch.stack([torch.randperm(HOT, generator=gen) for _ in range(max_bs)]).to(torch.int16).cuda()
        # The data plane's hit/miss tally, passed as the coordinator does.
        self.tally = torch.zeros(2, dtype=torch.int64, device="cuda")
        # The arrival counters, passed explicitly: the timing graphs are
        # captured on a side stream, which has no workspace of its own yet.
        self.workspace = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
        self.slot_tokens = self.slot_tokens0.clone()
        self.lru = self.lru0.clone()
        self.gen = gen
        # A recorded miss plan, replayed by the "gather" column.
        self.miss_src = torch.zeros((max_bs, TOP_K), dtype=torch.int64, device="cuda")
        self.miss_dst = torch.zeros((max_bs, TOP_K), dtype=torch.int32, device="cuda")
        self.miss_count = torch.zeros(max_bs, dtype=torch.int32, device="cuda")

    def top_k(self, bs: int, miss: float) -> torch.Tensor:
        n_miss = round(miss * TOP_K)
        rows = []
        for r in range(bs):
            hits = self.resident[r][torch.randperm(HOT, generator=self.gen)[: TOP_K - n_miss]]
            misses = self.absent[r][torch.randperm(self.absent[r].numel(), generator=self.gen)[:n_miss]]
            row = torch.cat([hits, misses])
            rows.append(row[torch.randperm(TOP_K, generator=self.gen)])
        return torch.stack(rows).to(torch.int32).cuda()

    def residency(self) -> dict:
        """Every request resident: position p maps through req_to_token
        (the identity here) to device row p modulo the pool's rows."""
        if not hasattr(self, "_residency"):
            self._residency = dict(
                resident=torch.ones(self.max_bs, dtype=torch.int32, device="cuda"),
                req_to_token=torch.arange(SEQ, dtype=torch.int32, device="cuda").repeat(self.max_bs, 1),
                token_to_row=(torch.arange(SEQ, device="cuda") % self.device_kv.shape[0]),
            )
        return self._residency

    def restore(self) -> None:
        self.slot_tokens.copy_(self.slot_tokens0)
        self.lru.copy_(self.lru0)


# --------------------------------------------------------------------------
# timing


class Timer:
    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup
        self.flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def median_us(self, fn, restore, per_graph: int = 16) -> tuple[float, str]:
        """Median device time of one fn() from restored state with a cold L2.

        Decode replays one CUDA graph holding every layer's call back to
        back, so launch latency is not part of a call's cost: ``per_graph``
        rounds of [restore, flush L2, fn] are captured in one graph, the same
        rounds without fn in another, and the difference per round is timed.
        """
        def rounds(with_fn: bool):
            for _ in range(per_graph):
                restore()
                self.flush_buf.zero_()
                if with_fn:
                    fn()

        for _ in range(self.warmup):
            restore()
            fn()
        torch.cuda.synchronize()
        try:
            graphs = []
            for with_fn in (True, False):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    rounds(with_fn)
                graphs.append(g)
            torch.cuda.synchronize()
            mode = "graph"
        except Exception as e:  # noqa: BLE001
            log(f"    (graph capture failed, timing eagerly: {type(e).__name__}: {e})")
            graphs, mode = [lambda: rounds(True), lambda: rounds(False)], "eager"
            graphs = [type("G", (), {"replay": staticmethod(g)})() for g in graphs]

        def elapsed_us(graph) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1000.0

        times = []
        for _ in range(self.iters):
            full, base = elapsed_us(graphs[0]), elapsed_us(graphs[1])
            times.append((full - base) / per_graph)
        return statistics.median(times), mode


def event_times_ms(fn, reps: int) -> list[float]:
    """``reps`` eager calls of fn, each timed alone with CUDA events (ms)."""
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def host_link_line() -> str:
    """One line for a run's header: this machine's pinned H2D copy rate and
    where the GPU sits among the host's NUMA nodes. On 2026-12-07-s7 an
    H100 ran ours' 8-layer decode step, 38.5 MiB of host misses a step, in
    4.80 ms where an H100 of 2026-12-07-s5 had taken 4.26 ms at the same
    misses, while base and native ran at the same rates on both; neither
    run had recorded its link. With this line in every run a ratio that
    involves host IO can be read against its machine."""
    import subprocess

    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        # nvidia-smi spells the domain with 8 hex digits, sysfs with 4.
        domain, rest = bus.lower().split(":", 1)
        node = Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node").read_text().strip()
    except Exception as exc:  # a header line must not stop the run
        node = f"? ({type(exc).__name__})"
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    return (f"host link: pinned H2D {h2d_ceiling_gbps():.1f} GB/s (cudaMemcpyAsync, 512 MiB, median of 7); "
            f"GPU 0 on NUMA node {node} of {nodes}")


def h2d_ceiling_gbps(nbytes: int = 512 << 20, reps: int = 7) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = [t / 1000.0 for t in event_times_ms(lambda: dst.copy_(src, non_blocking=True), reps)]
    return nbytes / statistics.median(times) / 1e9


# --------------------------------------------------------------------------
# kernels under test


def batch_inputs(bs: int):
    """Request slots 0..bs-1 at seq_len SEQ, the real-row count, two outputs."""
    def out():
        return torch.empty((bs, TOP_K), dtype=torch.int32, device="cuda")

    return (torch.arange(bs, dtype=torch.int64, device="cuda"),
            torch.full((bs,), SEQ, dtype=torch.int64, device="cuda"),
            torch.tensor([bs], dtype=torch.int32, device="cuda"), out(), out())


def ours(world: World, bs: int, top_k: torch.Tensor, out, num_real, seq_lens, reqs, *,
         skip_io=False, blocks_per_req=None, block_size=None, probe=None, **more):
    """``more``: further swap_in keywords (residency, hash_scale, a miss plan).
    Without ``probe`` and ``hash_scale`` this is the serving variant."""
    from sglang_hisparse.kernels.bench import swap_in_bench

    def call():
        swap_in_bench(top_k, reqs, seq_lens, num_real, world.slot_tokens, world.slot_locs,
                      world.lru, world.host_locs, world.host_kv, world.device_kv, out,
                      skip_io=skip_io, blocks_per_req=blocks_per_req, block_size=block_size,
                      tally=world.tally, probe=probe, workspace=world.workspace, **more)

    return call


def gather(world: World, bs: int, top_k, out, num_real, seq_lens, reqs, blocks_per_req=None):
    """Records ours' miss plan for this point (from the restored state) and
    returns a call that replays only its copies."""
    from sglang_hisparse.kernels.copy_planned import copy_planned

    world.restore()
    ours(world, bs, top_k, out, num_real, seq_lens, reqs, blocks_per_req=blocks_per_req,
         miss_src=world.miss_src[:bs], miss_dst=world.miss_dst[:bs], miss_count=world.miss_count[:bs])()
    torch.cuda.synchronize()

    def call():
        copy_planned(world.miss_src[:bs], world.miss_dst[:bs], world.miss_count[:bs], num_real,
                     world.host_kv, world.device_kv)

    return call


def median_phases(world: World, timer: Timer, call_with_probe, n: int) -> dict:
    """The kernel's phase stamps (us), median of ``n`` eager launches from the
    same state with L2 flushed; ``call_with_probe(probe)`` builds the call."""
    from sglang_hisparse.kernels import new_probe, probe_phases_us

    stamps = []
    for _ in range(n):
        world.restore()
        timer.flush_buf.zero_()
        probe = new_probe("cuda")
        call_with_probe(probe)()
        torch.cuda.synchronize()
        stamps.append(probe_phases_us(probe))
    return {k: statistics.median(d[k] for d in stamps) for k in stamps[0]}


def breakdown(world: World, timer: Timer, batches, misses) -> list[dict]:
    """Where one call's time goes (--breakdown).

    Per point: the kernel's own phase stamps (block (0, 0), cold L2, median
    of 15 eager launches), the graph-timed cost of the same call with one
    block per request and with other block sizes, and two floors that run
    no resolve at all: every request resident (positions translated through
    req_to_token) and every sequence shorter than the buffer.
    """

    rows = []
    for bs in batches:
        reqs = torch.arange(bs, dtype=torch.int64, device="cuda")
        seq_lens = torch.full((bs,), SEQ, dtype=torch.int64, device="cuda")
        short = torch.full((bs,), HOT, dtype=torch.int64, device="cuda")
        num_real = torch.tensor([bs], dtype=torch.int32, device="cuda")
        out = torch.empty((bs, TOP_K), dtype=torch.int32, device="cuda")
        for miss in misses:
            top_k = world.top_k(bs, miss)
            phases = median_phases(world, timer, lambda probe: ours(
                world, bs, top_k, out, num_real, seq_lens, reqs, probe=probe), 15)
            row = dict(batch=bs, miss=miss, phases_us=phases)
            variants = {"split=1": dict(blocks_per_req=1)}
            if bs == 1:
                variants.update({"split=8": dict(blocks_per_req=8), "split=32": dict(blocks_per_req=32)})
            for threads in (256, 512):
                variants[f"threads={threads}"] = dict(block_size=threads)
            for name, kw in variants.items():
                row[name], _ = timer.median_us(
                    ours(world, bs, top_k, out, num_real, seq_lens, reqs, **kw), world.restore)
            if miss == 0.0:
                row["floor_short_seq"], _ = timer.median_us(
                    ours(world, bs, top_k, out, num_real, short, reqs), world.restore)
                row["floor_resident"], _ = timer.median_us(
                    ours(world, bs, top_k, out, num_real, seq_lens, reqs, **world.residency()),
                    world.restore)
            rows.append(row)
            log(f"  bs {bs:>2} miss {miss * 100:>3.0f}%  "
                + "  ".join(f"{k} {v:.2f}" for k, v in phases.items()))
            log("      graph-timed us: " + "  ".join(
                f"{k} {v:.1f}" for k, v in row.items() if k not in ("batch", "miss", "phases_us")))
    return rows


def compare_hash_scales(world: World, timer: Timer, variants, batches, misses) -> list[dict]:
    """Hash scales side by side (--hash-scale): per point, each scale's
    graph-timed call (interleaved, so drift hits all alike), whether it
    leaves exactly the first scale's state, and its block (0, 0) phase stamps."""

    rows = []
    for bs in batches:
        reqs, seq_lens, num_real, out_a, out_b = batch_inputs(bs)
        for miss in misses:
            top_k = world.top_k(bs, miss)
            row = dict(batch=bs, miss=miss)
            for r in variants:
                fn = ours(world, bs, top_k, out_a, num_real, seq_lens, reqs, hash_scale=r)
                row[f"x{r}_us"], _ = timer.median_us(fn, world.restore)
                if r != variants[0]:
                    ref = ours(world, bs, top_k, out_b, num_real, seq_lens, reqs, hash_scale=variants[0])
                    row[f"x{r}_check"] = same_state(world, fn, ref, out_a, out_b)
                row[f"x{r}_phases"] = median_phases(world, timer, lambda probe: ours(
                    world, bs, top_k, out_a, num_real, seq_lens, reqs, hash_scale=r, probe=probe), 7)
            rows.append(row)
            log(f"  bs {bs:>2} miss {miss * 100:>3.0f}%  " + "  ".join(
                f"x{r} {row[f'x{r}_us']:.1f}" + (f" [{row[f'x{r}_check']}]" if f"x{r}_check" in row else "")
                for r in variants))
            for r in variants:
                log(f"      x{r} phases: " + " ".join(f"{k} {v:.2f}" for k, v in row[f"x{r}_phases"].items()))
    return rows


def upstream_0513(world: World, bs, top_k, out, num_real, seq_lens, reqs):
    from sglang.jit_kernel.hisparse import load_cache_to_device_buffer_mla

    def call():
        load_cache_to_device_buffer_mla(
            top_k_tokens=top_k, device_buffer_tokens=world.slot_tokens,
            host_cache_locs=world.host_locs, device_buffer_locs=world.slot_locs,
            host_cache=world.host_kv, device_buffer=world.device_kv,
            top_k_device_locs=out, req_pool_indices=reqs, seq_lens=seq_lens,
            lru_slots=world.lru, item_size_bytes=ITEM, num_top_k=TOP_K,
            hot_buffer_size=HOT, page_size=1, block_size=1024, num_real_reqs=num_real,
        )

    return call


def find_0523(path: str) -> tuple[Path, Path]:
    """(hisparse.cuh, include dir) of a 0.5.23 checkout or site-packages dir."""
    base = Path(path).expanduser().resolve()
    for cand in (base, base / "sglang", base / "python" / "sglang"):
        cuh = cand / "kernels" / "jit" / "csrc" / "kvcacheio" / "hisparse.cuh"
        inc = cand / "kernels" / "jit" / "include"
        if cuh.is_file() and inc.is_dir():
            return cuh, inc
    raise FileNotFoundError(f"no kernels/jit/csrc/kvcacheio/hisparse.cuh under {base}")


def load_0523(path: str):
    """Builds 0.5.23's swap-in kernel with 0.5.13's load_jit. Its headers
    must shadow 0.5.13's, so they replace the loader's default include dir
    for the duration of the build."""
    import sglang.jit_kernel.utils as jit

    cuh, inc = find_0523(path)
    # 0.5.23 production block size (coordinator default 960)
    args = jit.make_cpp_args(960, TOP_K, HOT, True, False, 1, False, False, False)
    saved = jit.DEFAULT_INCLUDE
    jit.DEFAULT_INCLUDE = [str(inc)]
    try:
        return jit.load_jit(
            "bench_sglang_0523_hisparse", *args,
            cuda_files=[str(cuh)],
            cuda_wrappers=[("load_cache_to_device_buffer", f"sglang::load_cache_to_device_buffer<{args}>")],
        )
    finally:
        jit.DEFAULT_INCLUDE = saved


def upstream_0523(module, world: World, bs, top_k, out, num_real, seq_lens, reqs):
    empty = torch.empty(0, device="cuda")

    def call():
        module.load_cache_to_device_buffer(
            top_k, world.slot_tokens, world.host_locs, world.slot_locs, world.host_kv, empty,
            world.device_kv, empty, out, reqs, seq_lens, world.lru, num_real, 1, ITEM,
            empty, empty, empty,
        )

    return call


# --------------------------------------------------------------------------


def prebuild(breakdown: bool, hash_scales=()) -> None:
    """Builds every kernel the run will time, several at once: each build is
    an nvcc subprocess, so threads overlap them (0.5.23's build swaps the
    loader's include path and runs alone afterwards). Ours: serving, skip-IO,
    plan recording (for the gather column) and the plan replay; with
    --breakdown the probe and other block sizes; each --hash-scale, with and
    without the probe."""
    from sglang_hisparse.kernels.bench import compile_bench_variants

    def upstream():
        try:
            from sglang.jit_kernel.hisparse import _jit_sparse_module
        except ImportError:
            return
        _jit_sparse_module(ITEM, 1024, TOP_K, HOT, is_mla=True, is_dsv4_layout=False)

    jobs = [dict(), dict(skip_io=(True,)), dict(record_plan=(True,)),
            dict(record_plan=(), copy_planned=True)]
    if breakdown:
        jobs += [dict(probe=(True,))] + [dict(block_size=t) for t in (256, 512)]
    for r in hash_scales:
        jobs += [dict(hash_scale=r), dict(hash_scale=r, probe=(True,))]
    compile_bench_variants(TOP_K, HOT, ITEM, jobs=jobs, also=[upstream])


def same_state(world: World, ours_fn, up_fn, out_a, out_b) -> str:
    """Same inputs, same rules: ours must leave exactly what 0.5.13 leaves."""
    world.restore()
    ours_fn()
    got = (out_a.clone(), world.slot_tokens.clone(), world.lru.clone(), world.device_kv.clone())
    world.restore()
    up_fn()
    want = (out_b.clone(), world.slot_tokens.clone(), world.lru.clone(), world.device_kv.clone())
    torch.cuda.synchronize()
    names = ("top_k_device_locs", "slot_tokens", "lru", "device_kv")
    bad = [n for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
    return "ok" if not bad else "MISMATCH " + ",".join(bad)


class VerifyWorld:
    """A speculative verify step's inputs (--verify): ``n`` rows per request,
    hot buffer (n + 1) x TOP_K (the config's default under speculation).

    Each request has committed SEQ - 1 tokens plus the step's first token
    (as the decode bench: the newest position SEQ - 1 at slot B); the verify
    forward has written its n tokens at slots B .. B + n - 1, positions
    SEQ - 1 .. SEQ + n - 2, and row j (length SEQ + j) selects position
    SEQ - 1 + j, keeps ``overlap`` of row 0's other entries and redraws the
    rest with the same hit/miss mix."""

    def __init__(self, n: int, max_bs: int, host_kv: torch.Tensor, seed: int = 0, overlap: float = 0.8):
        gen = torch.Generator().manual_seed(seed)
        self.n, self.hot, self.max_bs, self.overlap, self.gen = n, (n + 1) * TOP_K, max_bs, overlap, gen
        width = self.hot + PAGE
        self.host_kv = host_kv
        self.device_kv = torch.empty((max_bs * width, ITEM), dtype=torch.uint8, device="cuda")
        self.slot_locs = torch.randperm(max_bs * width, generator=gen).to(torch.int32).reshape(max_bs, width).cuda()
        self.host_locs = torch.randint(0, host_kv.shape[0], (max_bs, SEQ + n), generator=gen).cuda()
        st = torch.full((max_bs, width), -1, dtype=torch.int32)
        self.resident, self.absent = [], []
        for r in range(max_bs):
            perm = torch.randperm(SEQ - 1, generator=gen)
            st[r, :self.hot] = perm[:self.hot].to(torch.int32)
            st[r, self.hot:self.hot + n] = torch.arange(SEQ - 1, SEQ - 1 + n, dtype=torch.int32)
            self.resident.append(perm[:self.hot])
            self.absent.append(perm[self.hot:])
        self.slot_tokens0 = st.cuda()
        self.refill()
        self.lru0 = torch.stack([torch.randperm(self.hot, generator=gen)
                                 for _ in range(max_bs)]).to(torch.int16).cuda()
        self.slot_tokens, self.lru = self.slot_tokens0.clone(), self.lru0.clone()
        self.tally = torch.zeros(2, dtype=torch.int64, device="cuda")
        self.workspace = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
        self.miss_src = torch.zeros((max_bs, n * TOP_K), dtype=torch.int64, device="cuda")
        self.miss_dst = torch.zeros((max_bs, n * TOP_K), dtype=torch.int32, device="cuda")
        self.miss_count = torch.zeros(max_bs, dtype=torch.int32, device="cuda")

    def restore(self) -> None:
        self.slot_tokens.copy_(self.slot_tokens0)
        self.lru.copy_(self.lru0)

    def refill(self) -> None:
        """Every slot's row holds its token's bytes again (timed calls leave
        misses' bytes in their victims' rows; rows_served checks hits too)."""
        st = self.slot_tokens0.cpu()
        for r in range(self.max_bs):
            filled = st[r] >= 0
            locs = self.host_locs[r].cpu()[st[r][filled].long()]
            self.device_kv[self.slot_locs[r].cpu()[filled].long()] = self.host_kv[locs].to(
                self.device_kv.device)

    def _draw(self, r: int, k: int, miss: float) -> torch.Tensor:
        n_miss = round(miss * k)
        hits = self.resident[r][torch.randperm(self.hot, generator=self.gen)[: k - n_miss]]
        misses = self.absent[r][torch.randperm(self.absent[r].numel(), generator=self.gen)[:n_miss]]
        return torch.cat([hits, misses])

    def top_k(self, bs: int, miss: float) -> torch.Tensor:
        rows = []
        for r in range(bs):
            first = self._draw(r, TOP_K - 1, miss)
            for j in range(self.n):
                row = first.clone()
                redraw = torch.rand(row.numel(), generator=self.gen) > (1.0 if j == 0 else self.overlap)
                # Redrawn entries differ from the kept ones: a top-k row has distinct positions.
                fresh = torch.empty(0, dtype=row.dtype)
                while fresh.numel() < int(redraw.sum()):
                    cand = self._draw(r, TOP_K, miss)
                    cand = cand[~torch.isin(cand, torch.cat([row[~redraw], fresh]))]
                    fresh = torch.cat([fresh, cand])
                row[redraw] = fresh[: int(redraw.sum())]
                row = torch.cat([row, torch.tensor([SEQ - 1 + j])])
                rows.append(row[torch.randperm(TOP_K, generator=self.gen)])
        return torch.stack(rows).to(torch.int32).cuda()

    def inputs(self, bs: int):
        n = self.n
        return (torch.arange(bs, dtype=torch.int64, device="cuda"),
                torch.tensor([SEQ + j for _ in range(bs) for j in range(n)], dtype=torch.int64, device="cuda"),
                torch.tensor([bs], dtype=torch.int32, device="cuda"),
                torch.empty((bs * n, TOP_K), dtype=torch.int32, device="cuda"))

    def call(self, top_k, reqs, seq_lens, num_real, out, **kw):
        from sglang_hisparse.kernels.bench import swap_in_bench

        kw.setdefault("draft_tokens", self.n)

        def call():
            swap_in_bench(top_k, reqs, seq_lens, num_real, self.slot_tokens, self.slot_locs, self.lru,
                          self.host_locs, self.host_kv, self.device_kv, out, tally=self.tally,
                          workspace=self.workspace, **kw)

        return call

    def gather(self, top_k, reqs, seq_lens, num_real, out):
        from sglang_hisparse.kernels.copy_planned import copy_planned

        bs = reqs.numel()
        self.restore()
        self.call(top_k, reqs, seq_lens, num_real, out, miss_src=self.miss_src[:bs],
                  miss_dst=self.miss_dst[:bs], miss_count=self.miss_count[:bs])()
        torch.cuda.synchronize()
        moved = int(self.miss_count[:bs].sum())

        def call():
            copy_planned(self.miss_src[:bs], self.miss_dst[:bs], self.miss_count[:bs], num_real,
                         self.host_kv, self.device_kv)

        return call, moved


def verify_points(timer: Timer, ceiling: float, ndts, batches, misses, host_kv) -> list[dict]:
    """--verify: what a verify step's swap-in costs per layer, per draft-token
    count: the union call (n rows per request), the same call with its host
    copies skipped, the gather floor for the rows it moved, and the decode
    call (one row, same B) for scale. Every n > 1 point also checks that
    each row's output serves the right bytes."""
    from sglang_hisparse.kernels.bench import compile_bench_variants

    for n in ndts:
        compile_bench_variants(TOP_K, (n + 1) * TOP_K, ITEM, jobs=[
            dict(draft_tokens=(1, n)), dict(draft_tokens=(n,), skip_io=(True,)),
            dict(draft_tokens=(n,), record_plan=(True,), copy_planned=True)])
    rows = []
    log(f"{'ndt':>3} {'B':>6} {'bs':>3} {'miss':>5} {'moved':>7} {'bound':>8} {'verify':>8} {'noIO':>8} "
        f"{'gather':>8} {'decode':>8} {'v/gth':>6} {'v/dec':>6} rows")
    for n in ndts:
        world = VerifyWorld(n, max(batches), host_kv)
        for bs in batches:
            reqs, seq_lens, num_real, out = world.inputs(bs)
            one = batch_inputs(bs)
            for miss in misses:
                top_k = world.top_k(bs, miss)
                t_v, _ = timer.median_us(world.call(top_k, reqs, seq_lens, num_real, out), world.restore)
                t_noio, _ = timer.median_us(
                    world.call(top_k, reqs, seq_lens, num_real, out, skip_io=True), world.restore)
                gather_call, moved = world.gather(top_k, reqs, seq_lens, num_real, out)
                t_g = timer.median_us(gather_call, world.restore)[0] if moved else None
                # The decode call on the same buffers: row 0 of each request.
                t_d, _ = timer.median_us(world_decode(world, top_k, one), world.restore)
                world.restore()
                world.refill()
                world.call(top_k, reqs, seq_lens, num_real, out)()
                served = rows_served(world, top_k, seq_lens, out, bs)
                bound = max(moved * ITEM / (ceiling * 1e9) * 1e6, MIN_BOUND_US)
                log(f"{n:>3} {world.hot:>6} {bs:>3} {miss * 100:>4.0f}% {moved:>7} {bound:>8.1f} {t_v:>8.1f} "
                    f"{t_noio:>8.1f} {(f'{t_g:8.1f}' if t_g else '       -')} {t_d:>8.1f} "
                    f"{(f'{t_v / t_g:6.2f}' if t_g else '     -')} {t_v / t_d:>6.2f} {served}")
                rows.append(dict(draft_tokens=n, hot_buffer=world.hot, batch=bs, miss=miss, moved_rows=moved,
                                 bound_us=bound, verify_us=t_v, verify_skip_io_us=t_noio, gather_us=t_g,
                                 decode_us=t_d, rows_served=served))
        del world
        torch.cuda.empty_cache()
    return rows


def overlap_points(grids, bs: int, misses, replays: int, iters: int) -> list[dict]:
    """--overlap: can the IndexShare prefetch's copies run beside the forward?

    The prefetch replays an anchor's miss plan once per shared layer on a side
    stream while the forward stream computes. The replay's blocks loop until
    every miss has moved, so each block holds its SM for the whole replay;
    a compute kernel that needs a whole SM (GEMMs, attention) cannot start
    there until the replay ends. Per miss rate and replay grid
    (``engine.prefetch.ReplayGrid``: blocks x threads): the replays
    alone (``replays`` back to back, the shared layers of one anchor), a
    compute stand-in alone (per layer: one V3.2 layer's projection GEMMs at
    this batch and an attention call, as many layers as make it about as
    long as the replays), and both together on two streams; ``hidden`` is
    the share of the shorter one that the overlap hid:
    (copy + compute - both) / min(copy, compute). ``grids`` holds
    (ReplayGrid, high): with ``high`` the replays' stream has a higher
    priority than the compute's (SGLANG_HISPARSE_PREFETCH_PRIORITY=1)."""
    from sglang_hisparse.kernels.copy_planned import copy_planned

    world = World(bs)
    reqs, seq_lens, num_real, out, _ = batch_inputs(bs)
    gen = torch.Generator(device="cuda").manual_seed(1)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    # One DeepSeek-V3.2 layer's matrices at this batch (q_a + kv_a, q_b,
    # o_proj, a dense MLP of intermediate 2048) and a 2048-row attention.
    shapes = [(7168, 2112), (1536, 24576), (16384, 7168), (7168, 4096), (2048, 7168)]
    mats = [(torch.randn(bs, k, generator=gen, **bf), torch.randn(k, n, generator=gen, **bf))
            for k, n in shapes]
    q = torch.randn(bs, 16, 1, 128, generator=gen, **bf)
    kv = torch.randn(bs, 16, 2048, 128, generator=gen, **bf)
    sides = {False: torch.cuda.Stream(), True: torch.cuda.Stream(priority=-1)}

    def timed(fn) -> float:  # us, median of `iters` after 3 warm-up calls
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return statistics.median(event_times_ms(fn, iters)) * 1000.0

    def layer():
        for x, w in mats:
            x @ w
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv)

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    log(f"overlap: batch {bs}, {replays} replays per anchor, {sms} SMs")
    log(f"{'miss':>5} {'grid':>11} {'rows':>6} {'copy':>8} {'GB/s':>6} {'compute':>8} {'both':>8} {'hidden':>6}")
    for miss in misses:
        top_k = world.top_k(bs, miss)
        gather(world, bs, top_k, out, num_real, seq_lens, reqs)
        moved = int(world.miss_count[:bs].sum())
        n_layers = None
        for grid, high in grids:
            side = sides[high]
            label = f"{grid}{'@hi' if high else ''}"

            def copies(grid=grid):
                for _ in range(replays):
                    copy_planned(world.miss_src[:bs], world.miss_dst[:bs], world.miss_count[:bs],
                                 num_real, world.host_kv, world.device_kv, num_blocks=grid.blocks,
                                 threads=grid.threads)

            t_copy = timed(copies)
            if n_layers is None:  # compute sized once per miss rate, to the full grid's copies
                t_layer = timed(layer)
                n_layers = max(1, round(t_copy / t_layer))

            def compute():
                for _ in range(n_layers):
                    layer()

            def both(side=side):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    copies()
                compute()
                torch.cuda.current_stream().wait_stream(side)

            t_comp, t_both = timed(compute), timed(both)
            hidden = (t_copy + t_comp - t_both) / min(t_copy, t_comp)
            gbps = moved * replays * ITEM / (t_copy * 1e-6) / 1e9
            log(f"{miss * 100:>4.0f}% {label:>11} {moved:>6} {t_copy:>8.1f} {gbps:>6.1f} {t_comp:>8.1f} "
                f"{t_both:>8.1f} {hidden:>6.2f}")
            rows.append(dict(miss=miss, grid=str(grid), high_priority=high, moved_rows=moved, replays=replays,
                             copy_us=t_copy, compute_us=t_comp, both_us=t_both, hidden=hidden,
                             compute_layers=n_layers, copy_gbps=gbps))
    return rows


def world_decode(world: VerifyWorld, top_k, one):
    """The decode call (one row per request: each request's row 0) on the
    verify world's buffers."""
    reqs, seq_lens, num_real, out, _ = one
    first = top_k.view(-1, world.n, TOP_K)[:, 0].contiguous()
    return world.call(first, reqs, seq_lens, num_real, out, draft_tokens=1)


def rows_served(world: VerifyWorld, top_k, seq_lens, out, bs: int) -> str:
    """Every valid entry of every row reads its host bytes."""
    torch.cuda.synchronize()
    n = world.n
    bad = 0
    for b in range(bs * n):
        r = b // n
        toks = top_k[b].long()
        valid = (toks >= 0) & (toks < seq_lens[b])
        want = world.host_kv[world.host_locs[r, toks[valid]].cpu()]
        got = world.device_kv[out[b][valid].long()].cpu()
        bad += int((want != got).any(1).sum())
    return "ok" if bad == 0 else f"MISMATCH {bad} entries"


def trace_miss_rates(spec: str) -> int:
    """The calibration cross-check: the swap-in kernel's own tally on the
    synthetic trace (100 warm-up and 200 counted decode steps of one request,
    hot buffer HOT) against the torch reference on the CPU."""
    from sglang_hisparse.kernels import synthetic_top_k as st

    trace = st.parse(spec)
    log(f"synthetic trace {trace}: top-k {TOP_K}, hot buffer {HOT}")
    for seq_len in (16384, 32768, 65536):
        rates = [st.simulate_miss_rate(trace, seq_len=seq_len, hot_buffer_size=HOT, top_k=TOP_K,
                                       steps=200, warmup=100, device=d) for d in ("cuda", "cpu")]
        log(f"  {seq_len:>6} tokens: kernel miss rate {rates[0]:.4f}, reference {rates[1]:.4f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-link", action="store_true",
                    help="print the pinned H2D copy rate and the GPU's NUMA node, and stop")
    ap.add_argument("--quick", action="store_true", help="batch {1, 32} x miss {0, 13, 100}, fewer iterations")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    ap.add_argument("--upstream-0523", metavar="DIR", help="SGLang 0.5.23 package dir (site-packages/sglang or a checkout)")
    ap.add_argument("--blocks-per-req", type=int, default=None, help="override our blocks per request")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-check", action="store_true", help="skip the ours-vs-0.5.13 state comparison")
    ap.add_argument("--hash-scale", metavar="S,S,..",
                    help="compare the resolve's hash buckets per top-k entry side by side, e.g. 2,4,8")
    ap.add_argument("--hash-scale-only", action="store_true", help="with --hash-scale: skip the main table")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print where our call's time goes: phase stamps, split and "
                         "block-size variants, no-resolve floors")
    ap.add_argument("--trace", metavar="SPEC", nargs="?", const="calibrated",
                    help="only print the miss rate a synthetic top-k trace (SGLANG_HISPARSE_SYNTHETIC_TOPK "
                         "spec, default calibrated) gets from the kernel at 16K/32K/64K contexts, "
                         "beside the torch reference's")
    ap.add_argument("--verify", metavar="N,N,..", nargs="?", const="2,4",
                    help="only time speculative verify calls (N draft tokens per request, one union, "
                         "hot buffer (N + 1) x top_k), beside the gather floor and the decode call")
    ap.add_argument("--overlap", metavar="GRID,..", nargs="?", const="smx512,16x512,8x512,smx32,264x32",
                    help="only time the copy-only replay (the IndexShare prefetch) beside a compute "
                         "stand-in on another stream, per replay grid (SGLANG_HISPARSE_PREFETCH_GRID "
                         "spelling: BLOCKSxTHREADS; GRID@hi: the replays' stream at a higher "
                         "priority, SGLANG_HISPARSE_PREFETCH_PRIORITY=1)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        log("bench_kernels: no CUDA device visible; nothing to measure")
        return 2
    if args.trace:
        return trace_miss_rates(args.trace)
    if args.host_link:
        log(host_link_line())
        return 0
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    batches = [1, 32] if args.quick else [1, 8, 32, 64]
    misses = [0.0, 0.13, 1.0] if args.quick else [0.0, 0.13, 0.40, 1.0]
    iters = args.iters or (10 if args.quick else 30)
    timer = Timer(iters=iters, warmup=3)

    dev = torch.cuda.get_device_properties(0)
    log(f"device: {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}")
    ceiling = h2d_ceiling_gbps()
    log(f"pinned H2D ceiling (cudaMemcpyAsync, 512 MiB): {ceiling:.1f} GB/s")

    if args.overlap:
        from sglang_hisparse.engine.prefetch import ReplayGrid
        from sglang_hisparse.kernels.bench import compile_bench_variants

        grids = []
        for entry in args.overlap.split(","):
            spec, _, priority = entry.partition("@")
            if priority not in ("", "hi"):
                ap.error(f"--overlap: {entry!r}: allowed GRID or GRID@hi")
            grids.append((ReplayGrid.parse(spec, "--overlap"), priority == "hi"))
        compile_bench_variants(TOP_K, HOT, ITEM, jobs=[
            dict(record_plan=(True,)),
            dict(record_plan=(), copy_planned=True,
                 copy_planned_threads=tuple(dict.fromkeys(g.threads for g, _ in grids)))])
        orows = overlap_points(grids, 16, [0.02, 0.13, 0.5], 3, iters if args.iters else 20)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                device=dev.name, h2d_ceiling_gbps=ceiling, item_bytes=ITEM, overlap=orows), indent=2))
        return 0
    if args.verify:
        host_kv = torch.randint(0, 256, (HOST_ROWS, ITEM), dtype=torch.uint8).pin_memory()
        ndts = [int(x) for x in args.verify.split(",")]
        vrows = verify_points(timer, ceiling, ndts, [1, 8, 32] if not args.quick else [1, 32],
                              [0.0, 0.13, 0.40], host_kv)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                device=dev.name, h2d_ceiling_gbps=ceiling, top_k=TOP_K, seq_len=SEQ, verify=vrows), indent=2))
        return 0

    world = World(max(batches))
    variants = [int(x) for x in args.hash_scale.split(",")] if args.hash_scale else []
    prebuild(args.breakdown, variants)
    scale_rows = []
    if variants:
        log(f"hash scales {variants} (graph-timed us; [state vs x{variants[0]}]):")
        scale_rows = compare_hash_scales(world, timer, variants, batches, misses)
        if args.hash_scale_only:
            if args.json:
                Path(args.json).write_text(json.dumps(dict(
                    device=dev.name, h2d_ceiling_gbps=ceiling, hash_scales=scale_rows), indent=2))
            return 0

    mod_0523, why_0523 = None, "not requested (--upstream-0523 DIR)"
    if args.upstream_0523:
        try:
            mod_0523 = load_0523(args.upstream_0523)
            why_0523 = ""
        except Exception as e:  # noqa: BLE001
            why_0523 = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log(f"SGLang 0.5.23 kernel unavailable, column skipped: {why_0523}")
            traceback.print_exc(limit=1)
    have_0513 = True
    try:
        from sglang.jit_kernel.hisparse import load_cache_to_device_buffer_mla  # noqa: F401
    except Exception as e:  # noqa: BLE001
        have_0513 = False
        log(f"SGLang 0.5.13 kernel unavailable: {e}")

    from sglang_hisparse.kernels import DEFAULT_BLOCK_SIZE, default_blocks_per_req

    rows = []
    header = (f"{'bs':>3} {'miss':>5} {'MB':>7} {'bound':>8} {'ours':>8} {'ours/noIO':>9} "
              f"{'0.5.13':>8} {'0.5.23':>8} {'gather':>8} {'ours/bnd':>8} {'ours/gth':>8} "
              f"{'ours/up':>7} {'split':>5} check")
    log(header)
    for bs in batches:
        reqs, seq_lens, num_real, out_a, out_b = batch_inputs(bs)
        split = args.blocks_per_req or default_blocks_per_req(
            torch.device("cuda"), bs, TOP_K, DEFAULT_BLOCK_SIZE)
        for miss in misses:
            top_k = world.top_k(bs, miss)
            n_bytes = bs * round(miss * TOP_K) * ITEM
            bound = max(n_bytes / (ceiling * 1e9) * 1e6, MIN_BOUND_US)
            fn = ours(world, bs, top_k, out_a, num_real, seq_lens, reqs, blocks_per_req=args.blocks_per_req)
            t_ours, mode = timer.median_us(fn, world.restore)
            t_noio, _ = timer.median_us(
                ours(world, bs, top_k, out_a, num_real, seq_lens, reqs, skip_io=True,
                     blocks_per_req=args.blocks_per_req), world.restore)
            t_gather = None
            if miss > 0:
                t_gather, _ = timer.median_us(
                    gather(world, bs, top_k, out_a, num_real, seq_lens, reqs, args.blocks_per_req),
                    world.restore)
            t_13 = t_23 = None
            check = "-"
            if have_0513:
                up = upstream_0513(world, bs, top_k, out_b, num_real, seq_lens, reqs)
                t_13, _ = timer.median_us(up, world.restore)
                if not args.no_check:
                    check = same_state(world, fn, up, out_a, out_b)
            if mod_0523 is not None:
                try:
                    t_23, _ = timer.median_us(
                        upstream_0523(mod_0523, world, bs, top_k, out_b, num_real, seq_lens, reqs),
                        world.restore)
                except Exception as e:  # noqa: BLE001
                    log(f"    0.5.23 call failed: {e}")
            best_up = min([t for t in (t_13, t_23) if t is not None], default=None)
            r_bound = t_ours / bound
            r_up = t_ours / best_up if best_up else None
            fmt = lambda t: f"{t:8.1f}" if t is not None else f"{'-':>8}"  # noqa: E731
            r_gather = t_ours / t_gather if t_gather else None
            log(f"{bs:>3} {miss * 100:>4.0f}% {n_bytes / 1e6:>7.2f} {bound:>8.1f} {t_ours:>8.1f} "
                f"{t_noio:>9.1f} {fmt(t_13)} {fmt(t_23)} {fmt(t_gather)} {r_bound:>8.2f} "
                f"{(f'{r_gather:8.2f}' if r_gather else '       -')} "
                f"{(f'{r_up:7.2f}' if r_up else '      -')} {split:>5} {check}"
                + ("" if r_bound <= TARGET_RATIO else "  <-- over bound target")
                + ("" if r_up is None or r_up <= 1.0 else "  <-- slower than upstream"))
            rows.append(dict(
                batch=bs, miss=miss, bytes=n_bytes, bound_us=bound, ours_us=t_ours,
                ours_skip_io_us=t_noio, sglang_0513_us=t_13,
                sglang_0523_us=t_23, gather_us=t_gather,
                ours_over_bound=r_bound, ours_over_gather=r_gather, ours_over_best_upstream=r_up,
                blocks_per_req=split, timing=mode, check_vs_0513=check,
            ))
    worst = max(r["ours_over_bound"] for r in rows)
    log(f"worst ours/bound: {worst:.2f} (target <= {TARGET_RATIO})")
    phases = []
    if args.breakdown:
        log("breakdown (phase stamps in us, block (0, 0); then graph-timed variants):")
        phases = breakdown(world, timer, [1, 64] if not args.quick else [1],
                           [0.0, 1.0])
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=dev.name, sms=dev.multi_processor_count, h2d_ceiling_gbps=ceiling,
            top_k=TOP_K, hot_buffer=HOT, page=PAGE, seq_len=SEQ, item_bytes=ITEM,
            iters=iters, sglang_0523=why_0523 or "ok", rows=rows, breakdown=phases,
            hash_scales=scale_rows,
        ), indent=2))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
