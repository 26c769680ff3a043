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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reqs", default="1,8,16")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    print(f"{'requests':>8} {'hot buffers us/step':>20} {'resident us/step':>17}")
    for n in (int(x) for x in args.reqs.split(",")):
        hb = run(n, args.steps, residency=False)
        res = run(n, args.steps, residency=True)
        print(f"{n:>8} {hb:>20.0f} {res:>17.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
