#!/usr/bin/env python3
"""How host memory is pinned vs the swap-in kernel's zero-copy read rate.

The swap-in kernel reads each missed row (1152 B) straight from pinned host
memory; rows are scattered over the whole pool. This prints, for each
pinning mode of :mod:`sglang_hisparse.pools.host_memory`, our kernel's median us
per layer call (graph-timed, L2 flushed, as in bench_kernels.py) and the
rate it reaches, next to the pinned cudaMemcpyAsync ceiling, all in one run:

    python scripts/bench_host_memory.py [--gib 2] [--modes cuda_host_alloc,registered]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_kernels as bk  # noqa: E402

from sglang_hisparse.pools import host_memory  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="host pool size (GiB)")
    ap.add_argument("--modes", default=",".join(host_memory.MODES))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--misses", default="0.4,1.0")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host_memory: no CUDA device visible")
        return 2
    torch.cuda.init()
    ceiling = bk.h2d_ceiling_gbps()
    print(f"pinned H2D ceiling: {ceiling:.1f} GB/s", flush=True)
    timer = bk.Timer(iters=args.iters, warmup=3)
    batches = [int(x) for x in args.batches.split(",")]
    misses = [float(x) for x in args.misses.split(",")]
    rows = int(args.gib * 2**30) // bk.ITEM
    print(f"{'mode':<16} {'bs':>3} {'miss':>5} {'us':>9} {'GB/s':>7} {'of ceiling':>10}", flush=True)
    for mode in args.modes.split(","):
        try:
            host_kv = host_memory.alloc_pinned((rows, bk.ITEM), torch.uint8, mode=mode)
        except Exception as e:  # noqa: BLE001
            print(f"{mode:<16} unavailable: {e}", flush=True)
            continue
        world = bk.World(max(batches), host_kv=host_kv)
        for bs in batches:
            reqs = torch.arange(bs, dtype=torch.int64, device="cuda")
            seq_lens = torch.full((bs,), bk.SEQ, dtype=torch.int64, device="cuda")
            num_real = torch.tensor([bs], dtype=torch.int32, device="cuda")
            out = torch.empty((bs, bk.TOP_K), dtype=torch.int32, device="cuda")
            for miss in misses:
                top_k = world.top_k(bs, miss)
                t, _ = timer.median_us(bk.ours(world, bs, top_k, out, num_real, seq_lens, reqs),
                                       world.restore)
                nbytes = bs * round(miss * bk.TOP_K) * bk.ITEM
                rate = nbytes / (t * 1e-6) / 1e9
                print(f"{mode:<16} {bs:>3} {miss * 100:>4.0f}% {t:>9.1f} {rate:>7.1f} "
                      f"{rate / ceiling:>10.2f}", flush=True)
        del world
        host_memory.release(host_kv)
        del host_kv
    return 0


if __name__ == "__main__":
    sys.exit(main())
