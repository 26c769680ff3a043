#!/usr/bin/env python3
"""Scheduler-side CPU cost of the data plane per decode step.

On the GPU server this Python runs on the scheduler thread every decode
step; when it is longer than the GPU's step it is the step. Real SGLang
0.5.13 pools on the CPU, N requests decoding; per step it times what the
scheduler calls into our code: ``map_last_loc_to_buffer`` (write-through,
growth, newest slot) and ``available_size()`` five times (memory checks,
pool stats, admission: an H200 profile counted 2.3 calls per step for a lone
streamed request, more while prompts wait). Prints microseconds per step for
hot-buffer requests (residency off) and resident ones:

    python scripts/bench_scheduler_cpu.py [--reqs 1,8,16] [--steps 300]

``--verify N`` times a speculative verify step instead (N draft tokens, MTP
on 0.5.13): what our seams add around the target's verify forward for
hot-buffer requests, ``VerifyStep.map_slots`` (host rows up to the spec
reserve, the verify slots' mapping) and ``VerifyStep.commit`` (write-through
of the n positions, the slots unmapped); the spec reserve itself is
SGLang's, and the swap-in kernel is not Python:

    python scripts/bench_scheduler_cpu.py --verify 2 [--reqs 1,7]   (at most 8 requests)

``--after K`` also times them after K other requests have been staged,
verified and finished, in groups of at most 7: whether our seams cost a
lone request more once the capacity workload has run through the pools.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def run(n_reqs: int, steps: int, residency: bool, prompt: int = 600) -> float:
    from dataplane_fixtures import (
        PS, dsa_pool, kv_allocated_len, make_req, prefill, req_pool, set_kv_allocated_len, t64,
    )
    from sglang_hisparse.pools.allocator import HiSparseDualAllocator
    from sglang_hisparse.adapter.model_runner import HiSparseCoordinator

    hot, top_k = 256, 64
    phys = n_reqs * (prompt + steps + 2 * PS) + 4 * PS
    pool = dsa_pool(phys)
    r2t = req_pool(n_reqs + 1, prompt + steps + PS)
    alloc = HiSparseDualAllocator(phys, PS, torch.bfloat16, "cpu", pool, False, 4)
    coord = HiSparseCoordinator(r2t, alloc, top_k, hot, "cpu", None, 4, residency=residency)
    reqs = []
    for i in range(n_reqs):
        req = make_req(f"r{i}", prompt)
        prefill(r2t, alloc, req, prompt, pool=pool)
        coord.admit_request_into_staging(req)
        reqs.append(req)
    coord.collect_ready_reqs()
    rpi = t64(*[r.req_pool_idx for r in reqs])
    times = []
    for _ in range(steps):
        seq = t64(*[kv_allocated_len(r) for r in reqs])
        last = r2t.req_to_token[rpi, seq - 1].to(torch.int64)
        out = alloc.alloc_decode(seq + 1, seq + 1, last)  # SGLang's (Triton, interpreted here)
        r2t.req_to_token[rpi, seq] = out.to(torch.int32)
        for r in reqs:
            set_kv_allocated_len(r, kv_allocated_len(r) + 1)
        seq = seq + 1
        t0 = time.perf_counter()
        coord.map_last_loc_to_buffer(seq, out, rpi, seq.clone(), rpi.clone())
        for _ in range(5):
            alloc.available_size()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _verify_steps(env, reqs, committed, steps: int, draft_tokens: int) -> list:
    """``steps`` verify steps of ``reqs`` (nothing accepted, as with random
    weights); the seconds each step's seams took. ``committed`` moves on."""
    from dataplane_fixtures import kv_allocated_len, t64, verify_locs
    from test_verify_step import reserve

    rpi = [r.req_pool_idx for r in reqs]
    times = []
    for _ in range(steps):
        for r, c in zip(reqs, committed):  # SGLang's reserve: two steps of draft tokens ahead
            reserve(env, r, c + 2 * draft_tokens)
        locs = verify_locs(env.r2t, reqs, committed, draft_tokens)
        allocated = [kv_allocated_len(r) for r in reqs]
        seq = t64(*committed)
        t0 = time.perf_counter()
        env.coord.verify.map_slots(rpi, allocated, seq, locs)
        env.coord.verify.commit()
        times.append(time.perf_counter() - t0)
        committed[:] = [c + 1 for c in committed]
        for r, c in zip(reqs, committed):
            r.kv_committed_len = c
    return times


# The requests --after stages at once (the test Env has 8 request slots).
_AT_ONCE = 7


def run_verify(n_reqs: int, steps: int, draft_tokens: int, prompt: int = 600,
               after: int = 0, after_steps: int = 32) -> float:
    """Median µs of the verify seams per step for ``n_reqs`` hot-buffer
    requests; with ``after``, only once that many requests have been staged,
    verified ``after_steps`` steps and finished before them (in groups of
    at most 7), as a lone request follows the capacity workload."""
    from dataplane_fixtures import speculative_server_args
    from test_coordinator import Env

    per_req = prompt + max(steps, after_steps) * draft_tokens + 256
    # The same pools with or without --after, so that only the history differs.
    env = Env(phys=max(n_reqs, _AT_ONCE) * per_req + 1024, draft_tokens=draft_tokens)
    done = 0
    while done < after:
        group = [env.staged(f"a{done + k}", prompt) for k in range(min(_AT_ONCE, after - done))]
        env.coord.collect_ready_reqs()
        _verify_steps(env, group, [prompt] * len(group), after_steps, draft_tokens)
        with speculative_server_args():
            for r in group:
                env.finish(r)
        done += len(group)
    assert env.drained(), "the requests before the timed ones leaked rows"
    reqs = [env.staged(f"r{i}", prompt) for i in range(n_reqs)]
    env.coord.collect_ready_reqs()  # hot buffers (prompt > B), residency off
    times = _verify_steps(env, reqs, [prompt] * n_reqs, steps, draft_tokens)
    with speculative_server_args():
        for r in reqs:
            env.finish(r)
    assert env.drained(), "the verify bench leaked rows"
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reqs", default="1,8,16")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--verify", type=int, default=0, metavar="N",
                    help="time a verify step with N draft tokens instead (2..page size)")
    ap.add_argument("--after", type=int, default=0, metavar="K",
                    help="with --verify: also time the requests after K others have been "
                         "verified and finished (a lone request after the capacity workload)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="with --after: alternated rounds of both; medians and each round's ratio")
    args = ap.parse_args(argv)
    if args.verify:
        cols = f"{'verify map_slots + commit us/step':>34}"
        if args.after:
            cols += f" {f'after {args.after} finished':>18} {'ratio':>6}"
        print(f"{'requests':>8} {cols}")
        for n in (int(x) for x in args.reqs.split(",")):
            if not args.after:
                print(f"{n:>8} {run_verify(n, args.steps, args.verify):>34.0f}", flush=True)
                continue
            # Alternated, so that a slower stretch of this machine's cores
            # (2x apart from one minute to the next here) meets both.
            fresh, later = [], []
            for _ in range(args.rounds):
                fresh.append(run_verify(n, args.steps, args.verify))
                later.append(run_verify(n, args.steps, args.verify, after=args.after))
            ratios = [b / a for a, b in zip(fresh, later)]
            print(f"{n:>8} {statistics.median(fresh):>34.0f} {statistics.median(later):>18.0f} "
                  f"{statistics.median(ratios):>6.2f}  (rounds: "
                  + ", ".join(f"{r:.2f}" for r in ratios) + ")", flush=True)
        return 0
    print(f"{'requests':>8} {'hot buffers us/step':>20} {'resident us/step':>17}")
    for n in (int(x) for x in args.reqs.split(",")):
        hb = run(n, args.steps, residency=False)
        res = run(n, args.steps, residency=True)
        print(f"{n:>8} {hb:>20.0f} {res:>17.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
