"""How much of a measured inter-token gap is the benchmark client's own.

``e2e_gpu.py`` streams a workload's requests on threads of one process and
stamps each event as it arrives. This script serves the same shape of
stream from a stand-in (no model, no scheduler: every stream gets one event
per tick, and half of them end one tick before the rest, as a decode batch
does when its requests finish together) and reads it two ways, alternating:

- ``after``: what ``run_workload`` does, ``read_stream`` on each thread and
  ``parse_stream`` once every stream has ended;
- ``in-thread``: ``stream_generate`` on each thread, which parses and builds
  the result on the thread as its own stream ends. (Before 2026-12-07-s6
  the workloads parsed each event on arrival and built the result on the
  thread: 11.6-18.9x against 4.1-7.8x for ``after`` in three rounds each on
  a 2-core machine; this mode, parsing everything at the end, is worse.)

Any gap beyond the tick is the client's (or this machine's scheduling). It
prints, per round, each mode's median gap, p99 and worst gap over its own
median, then the medians of the worst ratios and their quotient.

    python3 scripts/client_gaps.py [--streams 16] [--tokens 2048] [--tick-ms 4.5] [--rounds 3]

The stand-in uses FastAPI and uvicorn, which SGLang installs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_gpu  # noqa: E402


def serve(port: int, streams: int, tokens: int, tick_s: float) -> None:
    """The stand-in: SGLang's incremental event (one token, its logprob and
    top-2) on every open stream each tick; the first half end a tick early."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    queues: dict = {}
    everyone_in = asyncio.Event()

    async def tick():
        await everyone_in.wait()
        while queues:
            t = time.time()
            for q in list(queues.values()):
                q.put_nowait(None)
            await asyncio.sleep(max(0.0, tick_s - (time.time() - t)))

    @app.post("/generate")
    async def generate():
        rid = len(queues)
        queue = queues[rid] = asyncio.Queue()
        end = tokens - (1 if rid < streams // 2 else 0)
        if len(queues) == streams:
            everyone_in.set()

        async def events():
            for i in range(end):
                await queue.get()
                last = i == end - 1
                logprob = [-0.5, 1000 + i, None]
                yield ("data: " + json.dumps({"output_ids": [1000 + i], "meta_info": {
                    "id": str(rid), "completion_tokens": i + 1, "prompt_tokens": 32000,
                    "finish_reason": {"type": "length", "length": end} if last else None,
                    "output_token_logprobs": [logprob],
                    "output_top_logprobs": [[logprob, [-1.5, 7, None]]]}}) + "\n\n").encode()
            queues.pop(rid)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}

    async def main():
        asyncio.get_running_loop().create_task(tick())
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).serve()

    asyncio.run(main())


def read_all(url: str, streams: int, tokens: int, mode: str) -> list:
    with e2e_gpu.client_gc_paused(), ThreadPoolExecutor(streams) as ex:
        if mode == "after":
            futs = [ex.submit(e2e_gpu.read_stream, url, [1, 2, 3], tokens) for _ in range(streams)]
            return [e2e_gpu.parse_stream(f.result()) for f in futs]
        futs = [ex.submit(e2e_gpu.stream_generate, url, [1, 2, 3], tokens) for _ in range(streams)]
        return [f.result() for f in futs]


@contextlib.contextmanager
def stand_in(port: int, streams: int, tokens: int, tick_ms: float):
    """The stand-in in its own process, ready; yields its URL."""
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--streams",
                               str(streams), "--tokens", str(tokens), "--tick-ms", str(tick_ms)])
    try:
        url = f"http://127.0.0.1:{port}"
        e2e_gpu.wait_healthy(url, server, timeout=20, poll_s=0.1)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def one_round(args, mode: str) -> dict:
    with stand_in(args.port, args.streams, args.tokens, args.tick_ms) as url:
        return e2e_gpu.gap_stats(read_all(url, args.streams, args.tokens, mode))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--tick-ms", type=float, default=4.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=30571)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.streams, args.tokens, args.tick_ms / 1000)
        return 0
    worst: dict = {"after": [], "in-thread": []}
    for r in range(args.rounds):
        for mode in ("after", "in-thread") if r % 2 == 0 else ("in-thread", "after"):
            st = one_round(args, mode)
            worst[mode].append(st["itg_worst_over_median"])
            print(f"round {r + 1} {mode:9s}: gap p50 {st['itg_p50_ms']:.2f} ms, p99 {st['itg_p99_ms']:.2f} ms, "
                  f"worst {st['itg_worst_over_median']:.1f}x its median", flush=True)
    after, in_thread = statistics.median(worst["after"]), statistics.median(worst["in-thread"])
    print(f"worst gap over its median, median of {args.rounds}: after {after:.1f}x, "
          f"in-thread {in_thread:.1f}x; in-thread / after {in_thread / after:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
