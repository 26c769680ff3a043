#!/usr/bin/env python3
"""Where a decode step's time goes: torch-profile a running server.

Launches one configuration of ``e2e_gpu.py`` (base / native / ours / noio),
starts N requests of L prompt tokens, lets them decode for a while, asks the
server's own profiler (``/start_profile``, CPU + GPU, Python stacks) for a
few decode steps, and prints a summary of the trace: wall time per step,
GPU kernel time per step by kernel, CUDA runtime calls (synchronizations
show up here), and the slowest Python functions of the scheduler process.

    python scripts/profile_decode.py --config ours --reqs 8 --prompt 9000 --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_gpu  # noqa: E402


def post(url: str, body: dict) -> str:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read().decode()


def summarize_trace(path: str, steps: int, top: int = 40) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    by_cat = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_cat[e.get("cat", "")].append(e)
    lines = []
    cpu = by_cat.get("cpu_op", []) + by_cat.get("python_function", [])
    if cpu:
        t0 = min(e["ts"] for e in cpu)
        t1 = max(e["ts"] + e["dur"] for e in cpu)
        lines.append(f"trace span {((t1 - t0) / 1000):.2f} ms over {steps} steps "
                     f"= {(t1 - t0) / 1000 / max(steps, 1):.2f} ms/step")

    def table(title, evs, key=lambda e: e["name"]):
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in evs:
            a = agg[key(e)]
            a[0] += e["dur"]
            a[1] += 1
        lines.append(f"-- {title}: total {sum(v[0] for v in agg.values()) / 1000 / max(steps, 1):.3f} ms/step")
        for name, (dur, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {dur / 1000 / max(steps, 1):9.3f} ms/step  {n / max(steps, 1):7.1f}/step  {name[:110]}")

    table("GPU kernels", by_cat.get("kernel", []))
    table("GPU memcpy/memset", by_cat.get("gpu_memcpy", []) + by_cat.get("gpu_memset", []))
    table("CUDA runtime", by_cat.get("cuda_runtime", []) + by_cat.get("cuda_driver", []))
    py = by_cat.get("python_function", [])
    if py:
        # The scheduler's main thread is the one running its event loop.
        loop = [e for e in py if "event_loop" in e["name"] or "run_batch" in e["name"]]
        main_tid = (loop[0]["pid"], loop[0]["tid"]) if loop else None
        mine = [e for e in py if (e["pid"], e["tid"]) == main_tid] if main_tid else py
        span = (max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)) if mine else 0
        # Self time: an event's duration minus its direct children's.
        mine.sort(key=lambda e: (e["ts"], -e["dur"]))
        self_us = collections.defaultdict(float)
        stack: list = []
        for e in mine:
            end = e["ts"] + e["dur"]
            while stack and stack[-1][1] <= e["ts"]:
                stack.pop()
            if stack:
                self_us[id(stack[-1][0])] -= e["dur"]
            self_us[id(e)] += e["dur"]
            stack.append((e, end))
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in mine:
            a = agg[e["name"]]
            a[0] += self_us[id(e)]
            a[1] += 1
        lines.append(f"-- scheduler main thread, Python self time (span {span / 1000:.1f} ms)")
        for name, (dur, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:30]:
            lines.append(f"  {dur / 1000 / max(steps, 1):9.3f} ms/step  {n / max(steps, 1):7.1f}/step  {name[:110]}")
        table("scheduler main thread, sglang/hisparse functions (inclusive)",
              [e for e in mine if ("sglang" in e["name"]) and e["dur"] < 0.5 * span], )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="ours")
    ap.add_argument("--model", default=os.environ.get("TINY_DSV32", ".gpu/tiny-dsv32"))
    ap.add_argument("--reqs", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16000)
    ap.add_argument("--new", type=int, default=400)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warm-s", type=float, default=3.0, help="decode this long before profiling")
    ap.add_argument("--extra", default="", help="extra server flags")
    ap.add_argument("--port", type=int, default=30020)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.config}_{args.reqs}x{args.prompt}"
    prof_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"prof_{tag}"  # traces are large
    prof_dir.mkdir(parents=True, exist_ok=True)
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = str(prof_dir)
    log = out / f"server_prof_{tag}.log"
    srv = e2e_gpu.Server(args.model, args.port, args.config, args.extra.split(), log)
    try:
        print(f"[{args.config}] ready in {srv.wait_ready():.0f}s", flush=True)
        results = []

        def one(seed):
            results.append(e2e_gpu.stream_generate(srv.url, e2e_gpu.make_ids(args.prompt, seed), args.new))

        threads = [threading.Thread(target=one, args=(s,)) for s in range(args.reqs)]
        for t in threads:
            t.start()
        time.sleep(args.warm_s)
        post(srv.url + "/start_profile", {"num_steps": args.steps, "activities": ["CPU", "GPU"],
                                          "with_stack": True, "output_dir": str(prof_dir)})
        for t in threads:
            t.join()
        time.sleep(2)
        stats = e2e_gpu.log_stats(log, 0)
        print(f"[{args.config}] {len(results)} done; decode step {stats['decode_step_ms']} ms, "
              f"running max {stats['max_running']}", flush=True)
        # The trace is written after the last profiled step; give it time.
        for _ in range(60):
            if glob.glob(str(prof_dir / "*.trace.json*")):
                break
            time.sleep(1)
    finally:
        srv.stop()
    traces = sorted(glob.glob(str(prof_dir / "*.trace.json*")))
    if not traces:
        print("no trace written")
        return 1
    text = summarize_trace(traces[0], args.steps)
    print(text)
    (out / f"profile_{tag}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
