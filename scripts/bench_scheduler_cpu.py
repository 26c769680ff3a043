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


def run_verify(n_reqs: int, steps: int, draft_tokens: int, prompt: int = 600) -> float:
    from dataplane_fixtures import kv_allocated_len, speculative_server_args, t64, verify_locs
    from test_coordinator import Env
    from test_verify_step import reserve

    env = Env(phys=n_reqs * (prompt + steps * draft_tokens + 256) + 1024, draft_tokens=draft_tokens)
    reqs = [env.staged(f"r{i}", prompt) for i in range(n_reqs)]
    env.coord.collect_ready_reqs()  # hot buffers (prompt > B), residency off
    rpi = [r.req_pool_idx for r in reqs]
    committed = [prompt] * n_reqs
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
        committed = [c + 1 for c in committed]  # random weights: nothing accepted
        for r, c in zip(reqs, committed):
            r.kv_committed_len = c
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
    args = ap.parse_args(argv)
    if args.verify:
        print(f"{'requests':>8} {'verify map_slots + commit us/step':>34}")
        for n in (int(x) for x in args.reqs.split(",")):
            print(f"{n:>8} {run_verify(n, args.steps, args.verify):>34.0f}", flush=True)
        return 0
    print(f"{'requests':>8} {'hot buffers us/step':>20} {'resident us/step':>17}")
    for n in (int(x) for x in args.reqs.split(",")):
        hb = run(n, args.steps, residency=False)
        res = run(n, args.steps, residency=True)
        print(f"{n:>8} {hb:>20.0f} {res:>17.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
