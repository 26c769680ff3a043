#!/usr/bin/env python3
"""Where a decode step's time goes: torch-profile a running server.

Launches configurations of ``e2e_gpu.py`` (base / native / ours / noio) one
after another, starts N requests of L prompt tokens in each, lets them
decode for a while, asks the server's own profiler (``/start_profile``, CPU +
GPU, optionally Python stacks) for a few decode steps, and prints a summary
of each trace: wall time per step, how much of it the GPU was busy (the
union of kernel and copy intervals) and idle, GPU kernel time per step by
kernel, CUDA runtime calls (synchronizations show up here), and with stacks
the slowest Python functions of the scheduler process. With several
configurations it ends with a side-by-side table. ``--thread-sample-s S``
first lists the threads on the whole machine that used the most CPU over S
seconds of decoding (a spinning neighbour slows the scheduler without
showing in its profile).

    python scripts/profile_decode.py --configs base,ours --reqs 1 --prompt 16000 \
        --new 3000 --warm-s 1.0 --no-stack --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_gpu  # noqa: E402


post = e2e_gpu.post_json  # a module name of its own: tests stand in for it


def gpu_busy_us(events: list) -> tuple[float, float]:
    """(busy, span) in us of GPU activity: the union of the intervals, so
    kernels overlapping on several streams count once, and the time from
    the first start to the last end."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    if not spans:
        return 0.0, 0.0
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, spans[-1][1] - spans[0][0]


def thread_cpu_times() -> dict:
    """{(pid, tid): (process name, thread name, cpu, ticks)} for every thread
    on the machine, from /proc (utime + stime, in clock ticks)."""
    out = {}
    for proc in glob.glob("/proc/[0-9]*"):
        pid = int(proc.rsplit("/", 1)[1])
        try:
            pname = Path(proc, "comm").read_text().strip()  # once per process, not per thread
        except OSError:
            continue
        for stat in glob.glob(f"{proc}/task/[0-9]*/stat"):
            try:
                text = Path(stat).read_text()
            except OSError:
                continue
            # The thread name is in parentheses and may itself contain spaces.
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            ticks = int(fields[11]) + int(fields[12])  # utime, stime
            out[(pid, int(stat.split("/")[4]))] = (pname, name, int(fields[36]), ticks)
    return out


def busiest_threads(seconds: float, top: int = 15) -> str:
    """The threads that used the most CPU over the next ``seconds``: a
    thread spinning beside the scheduler (an OpenMP pool, a poller) slows it
    down without appearing in its own profile."""
    hz = os.sysconf("SC_CLK_TCK")
    # Reading every thread's stat can itself take a second or more on a busy
    # machine: divide by the time between the snapshots' midpoints.
    t0 = time.monotonic()
    before = thread_cpu_times()
    t1 = time.monotonic()
    time.sleep(seconds)
    t2 = time.monotonic()
    after = thread_cpu_times()
    seconds = ((t2 + time.monotonic()) - (t0 + t1)) / 2
    rows = []
    for key, (pname, name, cpu, ticks) in after.items():
        used = ticks - before.get(key, (None, None, None, ticks))[3]
        if used > 0:
            rows.append((100.0 * used / hz / seconds, key, pname, name, cpu))
    rows.sort(reverse=True)
    lines = [f"busiest threads over {seconds:.1f} s (% of one core; cpu = last core it ran on):"]
    lines += [f"  {pct:6.1f}%  pid {pid:>7} tid {tid:>7}  cpu {cpu:>3}  {pname[:20]:20s} {name[:30]}"
              for pct, (pid, tid), pname, name, cpu in rows[:top]]
    return "\n".join(lines)


def summarize_trace(path: str, steps: int, top: int = 40, totals: dict | None = None) -> str:
    """Text summary of one trace; ``totals`` (if given) receives the per-step
    figures the side-by-side table needs."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    by_cat = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_cat[e.get("cat", "")].append(e)
    lines = []
    per = max(steps, 1)
    cpu = by_cat.get("cpu_op", []) + by_cat.get("python_function", [])
    trace_us = 0.0
    if cpu:
        t0 = min(e["ts"] for e in cpu)
        t1 = max(e["ts"] + e["dur"] for e in cpu)
        trace_us = t1 - t0
        lines.append(f"trace span {(trace_us / 1000):.2f} ms over {steps} steps "
                     f"= {trace_us / 1000 / per:.2f} ms/step")
    gpu = by_cat.get("kernel", []) + by_cat.get("gpu_memcpy", []) + by_cat.get("gpu_memset", [])
    busy, span = gpu_busy_us(gpu)
    if span:
        lines.append(f"GPU: busy {busy / 1000 / per:.3f} ms/step, idle {(span - busy) / 1000 / per:.3f} "
                     f"ms/step ({100 * busy / span:.0f}% busy over its {span / 1000:.2f} ms)")
    if totals is not None:
        totals.update({
            "trace_ms": trace_us / 1000 / per if trace_us else None,
            "gpu_span_ms": span / 1000 / per if span else None,
            "gpu_busy_ms": busy / 1000 / per,
            "gpu_idle_ms": (span - busy) / 1000 / per,
            "kernels_per_step": len(by_cat.get("kernel", [])) / per,
            "kernel_ms": {},
        })
        groups = totals["kernel_groups_ms"] = {}
        for e in by_cat.get("kernel", []):
            k = totals["kernel_ms"]
            k[e["name"]] = k.get(e["name"], 0.0) + e["dur"] / 1000 / per
            g = kernel_group(e["name"])
            groups[g] = groups.get(g, 0.0) + e["dur"] / 1000 / per
        for e in by_cat.get("gpu_memcpy", []):
            groups["memcpy"] = groups.get("memcpy", 0.0) + e["dur"] / 1000 / per

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


# Kernel name patterns, first match wins: what a decode step's GPU time is
# spent on. The swap-in reads host rows itself (SM loads of mapped pinned
# memory), so its time includes the host IO; the write-through of new tokens
# is HiCache's backup kernel on a side stream.
KERNEL_GROUPS = (
    ("synthetic top-k (benchmark only)", ("synthetic_top_k",)),
    ("exactness check (debug only)", ("exactness_check",)),
    ("swap-in (incl. host reads)", ("hisparse_plugin", "swap_in", "load_cache_to_device_buffer")),
    ("write-through", ("transfer_kv", "transfer_hicache", "transfer_cache", "hicache")),
    ("sparse attention", ("flash_mla", "flashmla", "sparse_attn", "mla_fwd", "fmha")),
    ("indexer + top-k", ("indexer", "topk", "top_k", "mqa_logits", "paged_mqa", "fp8_index")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "gemv", "deep_gemm")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, needles in KERNEL_GROUPS:
        if any(n in low for n in needles):
            return group
    return "other kernels"


def side_by_side(totals: dict, top: int = 25) -> str:
    """One column per configuration: step, GPU busy and idle, kernel count,
    then the kernels with the largest per-step difference."""
    cols = list(totals)
    lines = [f"{'per decode step':44s}" + "".join(f"{c:>12s}" for c in cols)]
    for key, unit in (("trace_ms", "ms"), ("gpu_span_ms", "ms"), ("gpu_busy_ms", "ms"), ("gpu_idle_ms", "ms"),
                      ("kernels_per_step", ""), ("decode_only_tok_s", "tok/s, server log"),
                      ("decode_only_running", ""), ("hisparse_hit_rate", ""),
                      ("itg_p50_ms", "ms"), ("itg_p99_ms", "ms"), ("itg_worst_over_median", "")):
        vals = [totals[c].get(key) for c in cols]
        lines.append(f"{key + (' (' + unit + ')' if unit else ''):44s}"
                     + "".join(f"{v:12.3f}" if v is not None else f"{'-':>12s}" for v in vals))
    lines.append("GPU time by kind (ms/step):")
    kinds = sorted({g for c in cols for g in totals[c].get("kernel_groups_ms", {})})
    for g in kinds:
        lines.append(f"  {g[:42]:42s}" + "".join(
            f"{totals[c].get('kernel_groups_ms', {}).get(g, 0.0):12.3f}" for c in cols))
    names = {n for c in cols for n in totals[c]["kernel_ms"]}
    spread = sorted(names, key=lambda n: -(max(totals[c]["kernel_ms"].get(n, 0.0) for c in cols)
                                           - min(totals[c]["kernel_ms"].get(n, 0.0) for c in cols)))
    lines.append("kernels (ms/step), largest difference first:")
    for n in spread[:top]:
        lines.append(f"  {n[:42]:42s}" + "".join(f"{totals[c]['kernel_ms'].get(n, 0.0):12.4f}" for c in cols))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", "--config", dest="configs", default="ours",
                    help="comma-separated configurations, profiled one after another; "
                         "NAME:N sends that one N requests instead of --reqs (base holds fewer), "
                         "and :plateau=S / :join=S give it its own --plateau-s / --join-timeout-s "
                         "(e.g. native:16:plateau=300:join=130,ours:16,base:2:plateau=15:join=60)")
    ap.add_argument("--synthetic", default=None, metavar="SPEC",
                    help="SGLANG_HISPARSE_SYNTHETIC_TOPK=SPEC in ours/nopark/noio/native (e.g. calibrated)")
    ap.add_argument("--hisparse-config", default=None, metavar="JSON")
    ap.add_argument("--model", default=os.environ.get("TINY_DSV32", ".gpu/tiny-dsv32"))
    ap.add_argument("--reqs", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16000)
    ap.add_argument("--new", type=int, default=400)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warm-s", type=float, default=3.0,
                    help="decode this long before profiling, counted from when the decode log "
                         "first shows every request running (or the count stops growing: "
                         "--plateau-s; or --join-timeout-s passes)")
    ap.add_argument("--join-timeout-s", type=float, default=300.0)
    ap.add_argument("--plateau-s", type=float, default=20.0,
                    help="profile once the running count has not grown for this long with no "
                         "prefill logged (a configuration that holds fewer than its requests)")
    ap.add_argument("--end-after-profile", type=float, default=0.0, metavar="S",
                    help="decode S s more after the trace is written, then stop the server "
                         "without waiting for the requests to finish: --new can then be long "
                         "enough that the first request still decodes when the last prompt "
                         "joins (a configuration that fills slowly), at no cost to the others; "
                         "the gap figures then cover only the requests that finished")
    ap.add_argument("--extra", default="", help="extra server flags")
    ap.add_argument("--mtp", default=None, metavar="STEPS,TOPK,NDT",
                    help="EAGLE/MTP as e2e_gpu.py --mtp runs it (the model given a NextN layer)")
    ap.add_argument("--port", type=int, default=30020)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-stack", action="store_true",
                    help="no Python stacks: far less profiler overhead on the CPU side")
    ap.add_argument("--thread-sample-s", type=float, default=0.0,
                    help="before profiling, sample every thread's CPU use on the machine for this long")
    args = ap.parse_args(argv)
    args.spec_flags = []
    if args.mtp:
        try:
            args.model, args.spec_flags = e2e_gpu.mtp_model_and_flags(
                args.model, Path(args.out), args.mtp)
        except ValueError as exc:
            ap.error(str(exc))
    # The servers run in their own empty directory (e2e_gpu.server_cwd): a
    # config directory given relative to here (or the MTP one under --out)
    # must be named absolutely, as e2e_gpu.py does.
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    try:
        runs = [parse_config_spec(spec, args) for spec in args.configs.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    e2e_gpu.exit_on_sigterm()
    totals: dict = {}
    rc = 0
    for run in runs:
        totals[run.label] = {}
        rc |= profile_one(args, run.config, totals[run.label], run.reqs,
                          plateau_s=run.plateau_s, join_timeout_s=run.join_timeout_s)
    profiled = {c: t for c, t in totals.items() if t}  # a failed launch has none
    if len(profiled) > 1:
        table = side_by_side(profiled)
        print(table)
        (Path(args.out) / "profile_side_by_side.txt").write_text(table)
    return rc


class ConfigRun(NamedTuple):
    """One entry of --configs: the configuration, its request count and its
    waits for the running count. The waits differ per configuration at 61
    layers (2026-12-07-s8: native needed a 300 s plateau and a 130 s join
    bound, ours 20 s, base 15 s and 60 s); with their own waits they can
    share one command's set-up."""
    config: str
    reqs: int
    plateau_s: float
    join_timeout_s: float

    @property
    def label(self) -> str:  # the side-by-side table's column
        return f"{self.config}:{self.reqs}"


def parse_config_spec(spec: str, args) -> ConfigRun:
    """``NAME[:N][:plateau=S][:join=S]``; what is not given comes from
    --reqs, --plateau-s and --join-timeout-s."""
    name, *parts = spec.split(":")
    if name not in e2e_gpu.CONFIGS:
        raise ValueError(f"--configs: unknown configuration {name!r} in {spec!r}; "
                         f"configurations: {', '.join(e2e_gpu.CONFIGS)}")
    fields = {"reqs": args.reqs, "plateau_s": args.plateau_s, "join_timeout_s": args.join_timeout_s}
    keys = {"plateau": "plateau_s", "join": "join_timeout_s"}
    for part in parts:
        key, eq, value = part.partition("=")
        try:
            if not eq and key.isdigit() and int(key) > 0:
                fields["reqs"] = int(key)
            elif eq and key in keys and float(value) > 0:
                fields[keys[key]] = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--configs: {part!r} in {spec!r} is not a request count (a positive "
                             f"integer), plateau=S or join=S (S seconds > 0)") from None
    return ConfigRun(name, **fields)


def wait_all_running(log: Path, reqs: int, timeout_s: float, plateau_s: float) -> tuple[float, int]:
    """(seconds waited, running count) once the server's decode log shows
    ``reqs`` running, or once its highest running count has not grown for
    ``plateau_s`` with no prefill logged meanwhile: the configuration's pool
    holds fewer (SGLang's native HiSparse ran 10-12 of 16 32K prompts on
    2026-12-06-s4/s5), and waiting for all of them would spend the whole
    join timeout and profile a draining batch. A prefill in the window
    (the next prompt being admitted) restarts it."""
    t0 = time.time()
    best, since, mark = 0, t0, 0
    while time.time() - t0 < timeout_s:
        text = log.read_text(errors="ignore")  # once a poll: the count and the prefills from it
        running = max(map(int, e2e_gpu._RUNNING.findall(text)), default=0)
        if running >= reqs:
            return time.time() - t0, running
        if running > best or "Prefill batch" in text[mark:]:
            best, since, mark = max(best, running), time.time(), len(text)
        elif best and time.time() - since >= plateau_s:
            return time.time() - t0, best
        time.sleep(0.5)
    return time.time() - t0, best


def profile_one(args, config: str, totals: dict, reqs: int, plateau_s: float,
                join_timeout_s: float) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{config}_{reqs}x{args.prompt}"
    prof_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"prof_{tag}"  # traces are large
    # A fresh folder: the summary reads the first trace found there.
    shutil.rmtree(prof_dir, ignore_errors=True)
    prof_dir.mkdir(parents=True)
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = str(prof_dir)
    log = out / f"server_prof_{tag}.log"
    hs_config = json.loads(args.hisparse_config) if args.hisparse_config else None
    srv = e2e_gpu.Server(args.model, args.port, config, args.extra.split(), log,
                         synthetic=args.synthetic, hs_config=hs_config, spec_flags=args.spec_flags)
    threads: list = []
    try:
        print(f"[{config}] ready in {srv.wait_ready():.0f}s", flush=True)
        # Each thread keeps its raw events; they are parsed after the streams
        # have ended, as run_workload does (read_stream says why).
        streams = []

        def one(seed):
            try:
                streams.append(e2e_gpu.read_stream(srv.url, e2e_gpu.make_ids(args.prompt, seed), args.new))
            except Exception:  # a reset, a cut chunk, a truncated event
                if not args.end_after_profile:
                    raise  # with it, the server is stopped under the streams on purpose

        threads = [threading.Thread(target=one, args=(s,)) for s in range(reqs)]
        # The client's own collections would land in the gaps it measures.
        with e2e_gpu.client_gc_paused():
            for t in threads:
                t.start()
            joined_s, running = wait_all_running(log, reqs, join_timeout_s, plateau_s)
            print(f"[{config}] {running} of {reqs} running after {joined_s:.0f}s", flush=True)
            time.sleep(args.warm_s)
            if args.thread_sample_s > 0:
                threads_text = busiest_threads(args.thread_sample_s)
                print(f"[{config}] {threads_text}", flush=True)
                (out / f"threads_{tag}.txt").write_text(threads_text + "\n")
            post(srv.url + "/start_profile", {"num_steps": args.steps, "activities": ["CPU", "GPU"],
                                              "with_stack": not args.no_stack,
                                              "output_dir": str(prof_dir)})
            if not args.end_after_profile:
                for t in threads:
                    t.join()
                time.sleep(2)
        # The trace is written after the last profiled step; give it time.
        for _ in range(60):
            if glob.glob(str(prof_dir / "*.trace.json*")):
                break
            time.sleep(1)
        if args.end_after_profile:
            time.sleep(args.end_after_profile)  # steady decode lines after the profiled steps
        results = [e2e_gpu.parse_stream(raw) for raw in list(streams)]
        stats = e2e_gpu.log_stats(log, 0)
        print(f"[{config}] {len(results)} done; decode step {stats['decode_step_ms']} ms, "
              f"running max {stats['max_running']}; decode-only {stats['decode_only_tok_s']} tok/s "
              f"at {stats['decode_only_running']} running; hit rate {stats['hisparse_hit_rate']}",
              flush=True)
        totals.update({k: stats[k] for k in ("decode_only_tok_s", "decode_only_running",
                                             "hisparse_hit_rate")})
        totals.update(e2e_gpu.gap_stats(results))
    finally:
        srv.stop()
        for t in threads:  # with --end-after-profile their streams end with the server
            t.join()
    traces = sorted(glob.glob(str(prof_dir / "*.trace.json*")))
    if not traces:
        print("no trace written (if the requests finished before the profiler started, "
              "raise --new)")
        return 1
    text = summarize_trace(traces[0], args.steps, totals=totals)
    print(f"== {config}\n{text}")
    (out / f"profile_{tag}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
