"""Read a run's longest inter-token gaps against what the scheduler did in them.

The client's gap is what a user sees; the step timer's timeline
(``STEPTIMER_TIMELINE=1`` with ``e2e_gpu.py --step-timer``: each batch's
``run_batch`` and ``process_batch_result``, each ``stream_output``, each join,
staging hand-over and finish, stamped with ``time.time()`` on the same machine as the client) says whether
the scheduler sent those tokens late (a slow ``process`` or ``join`` inside
the gap) or sent them on time and the gap grew after it (detokenizer,
tokenizer manager, HTTP, client).

    python3 scripts/gap_timeline.py STAMPS TIMELINE [--config C] [--top N]

STAMPS: a ``bound.json`` of ``e2e_gpu.py`` (requests under runs/C/<workload>)
or ``{C: [request, ...]}`` with each request's ``t0``, ``ttft`` and
``gaps_ms`` (``docs/gpu-runs/2026-12-07-s5/call9-client-stamps.json.xz``,
xz or not). TIMELINE: the server's ``timeline_<pid>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys


def _open(path):
    return lzma.open(path, "rt") if path.endswith(".xz") else open(path)


def load_requests(path: str, config: str) -> list:
    with _open(path) as f:
        data = json.load(f)
    if "runs" in data:
        [runs] = data["runs"][config].values()
        return runs[0]["requests"]
    return data[config]


def load_timeline(path: str) -> list:
    with _open(path) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda e: e[1])


def token_times(req: dict) -> list:
    """Wall-clock arrival of each of the request's tokens at the client."""
    t = req["t0"] + req["ttft"]
    out = [t]
    for g in req["gaps_ms"]:
        t += g / 1000
        out.append(t)
    return out


def worst_gaps(requests: list, top: int) -> list:
    """(gap ms, its ratio to the request's median, request, token, start, end), longest ratio first."""
    rows = []
    for i, req in enumerate(requests):
        gaps = req["gaps_ms"]
        if not gaps:
            continue
        median = statistics.median(gaps)
        times = token_times(req)
        j = max(range(len(gaps)), key=gaps.__getitem__)
        rows.append((gaps[j], gaps[j] / median, i, j + 1, times[j], times[j + 1]))
    return sorted(rows, key=lambda r: -r[1])[:top]


def stream_sends(timeline: list, start: float, end: float) -> list:
    """End times of the scheduler's stream_output calls in [start, end]."""
    return [e[2] for e in timeline if e[0] == "stream" and start <= e[2] <= end]


def events_in(timeline: list, start: float, end: float, min_ms: float) -> list:
    """Timeline entries overlapping [start, end] that last at least ``min_ms``."""
    return [e for e in timeline if e[2] >= start and e[1] <= end and (e[2] - e[1]) * 1000 >= min_ms]


def report(requests: list, timeline: list, top: int = 8, min_ms: float = 5.0) -> list:
    """Lines: for each of the longest gaps, the scheduler's sends inside it
    (their longest spacing is the scheduler's share of the gap) and its slow
    events there."""
    t0 = min(r["t0"] for r in requests)
    lines = []
    for gap, ratio, i, tok, a, b in worst_gaps(requests, top):
        # the sends of the gap's two tokens lie before their arrival
        sends = stream_sends(timeline, a - gap / 1000, b)
        spacing = max((y - x for x, y in zip(sends, sends[1:])), default=0.0) * 1000
        lines.append(f"req {i:2d} token {tok:5d} at {a - t0:8.3f} s: gap {gap:7.1f} ms ({ratio:6.1f}x its median); "
                     f"scheduler sends inside: {len(sends)}, longest spacing {spacing:.1f} ms")
        for what, s, e, detail in events_in(timeline, a - gap / 1000, b, min_ms):
            lines.append(f"    {what:8s} {s - t0:8.3f} s  {1000 * (e - s):7.1f} ms  {detail}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stamps")
    ap.add_argument("timeline")
    ap.add_argument("--config", default="ours")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--min-ms", type=float, default=5.0, help="list scheduler events at least this long")
    args = ap.parse_args(argv)
    for line in report(load_requests(args.stamps, args.config), load_timeline(args.timeline),
                       args.top, args.min_ms):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
