"""Diagnostic SGLang plugin: where a scheduler step's wall time goes.

Not part of sglang-hisparse. ``scripts/e2e_gpu.py --step-timer`` puts this
folder on the server's PYTHONPATH (its dist-info makes it an entry point of
``sglang.srt.plugins``) and sets STEPTIMER_OUT. In each scheduler process it
then times, inclusively, the functions one decode step runs through (the
same list with or without HiSparse, so a baseline and a HiSparse server can
be compared line by line), and rewrites STEPTIMER_OUT/steptimer_<pid>.json
four times a second with {function: [total seconds, calls]}. The driver
diffs two snapshots to get one workload's share.

Timers are installed when the scheduler's event loop starts, after every
plugin's hooks, so each timer wraps whatever SGLang and the other plugins
made of the function.

With STEPTIMER_SYNCS=1 torch's sync debug mode is set to "warn" in the
scheduler process and every synchronizing CUDA call (a blocking copy to or
from the device, ``.item()``, ``.tolist()`` of a device tensor, ...) is
counted by the Python stack that made it; the dump gains ``syncs``: [count,
[frame, ...]] per stack, most frequent first. A sync in the step's path
stalls the CPU until the GPU catches up, which undoes the overlap scheduler.

With STEPTIMER_TIMELINE=1 each scheduled batch's ``run_batch`` and
``process_batch_result``, every ``stream_output`` call, every join
(``collect_ready_reqs`` returning requests), every prefill's hand-over to
staging and every finish (the coordinator's) is also appended to
STEPTIMER_OUT/timeline_<pid>.jsonl as [what, start, end, detail] with
``time.time()`` stamps, which the driver's client stamps share (same
machine): a client's long gap can then be read against what the server did
in it. Only the new entries are written, four times a second, so the dump
holds the scheduler's GIL for no longer than a step's worth of lines.

With STEPTIMER_PROFILE=1 the scheduler thread also runs under cProfile
while it has batches to run, and STEPTIMER_OUT/profile_<pid>.prof (pstats
format, with the batch count in profile_<pid>.prof.json) is rewritten every
0.5 s from that thread; a file STEPTIMER_OUT/profile_reset starts it over.
``python hisparse_steptimer.py A B`` lists the functions whose own time per
batch differs most between two such folders, so what one configuration adds
to a step shows up by name. The profiler slows Python several-fold: use it
to attribute, never to time.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

# (module, class, method): the scheduler loop and what a decode step calls.
TIMED = [
    ("sglang.srt.managers.scheduler", "Scheduler", "process_input_requests"),
    ("sglang.srt.managers.scheduler", "Scheduler", "get_next_batch_to_run"),
    ("sglang.srt.managers.scheduler", "Scheduler", "get_new_batch_prefill"),
    ("sglang.srt.managers.scheduler", "Scheduler", "update_running_batch"),
    ("sglang.srt.managers.scheduler", "Scheduler", "run_batch"),
    ("sglang.srt.managers.scheduler", "Scheduler", "process_batch_result"),
    ("sglang.srt.managers.scheduler", "Scheduler", "launch_batch_sample_if_needed"),
    ("sglang.srt.managers.schedule_batch", "ScheduleBatch", "prepare_for_decode"),
    ("sglang.srt.managers.schedule_batch", "ScheduleBatch", "filter_batch"),
    ("sglang.srt.managers.tp_worker", "TpModelWorker", "forward_batch_generation"),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward"),
    ("sglang.srt.model_executor.cuda_graph_runner", "CudaGraphRunner", "replay_prepare"),
    ("sglang.srt.model_executor.cuda_graph_runner", "CudaGraphRunner", "replay"),
    # speculative (EAGLE v2) steps
    ("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2", "forward_batch_generation"),
    ("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2", "verify"),
    ("sglang.srt.speculative.eagle_worker_v2", "EagleDraftWorker", "draft"),
    ("sglang.srt.speculative.eagle_worker_v2", "EagleDraftWorker", "_draft_extend_for_decode"),
    ("sglang.srt.speculative.eagle_info_v2", "EagleDraftInputV2Mixin", "prepare_for_decode"),
    ("sglang.srt.speculative.eagle_info_v2", "EagleVerifyInputV2Mixin", "prepare_for_v2_verify"),
    ("sglang.srt.speculative.eagle_info_v2", "EagleVerifyInputV2Mixin", "sample"),
]
# Methods of whatever object the scheduler holds as its HiSparse coordinator.
COORDINATOR = ["map_last_loc_to_buffer", "collect_ready_reqs", "wait_for_pending_backup",
               "has_ongoing_staging", "request_finished"]

_stats: dict = {}
_syncs: dict = {}  # stack (tuple of "file:line:function") -> count
_timeline: list = []  # [what, start, end, detail] not yet written
_lock = threading.Lock()


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            entry = _stats.get(name)
            if entry is None:
                with _lock:
                    entry = _stats.setdefault(name, [0.0, 0])
            entry[0] += dt
            entry[1] += 1

    return wrapper


def _dump_forever(path: str, timeline_path=None) -> None:
    while True:
        time.sleep(0.25)
        with _lock:
            snap = {k: list(v) for k, v in _stats.items()}
            syncs = sorted(([n, list(st)] for st, n in _syncs.items()), reverse=True)
            lines = _timeline[:]
            del _timeline[:len(lines)]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"time": time.time(), "stats": snap, "syncs": syncs}, f)
        os.replace(tmp, path)
        if timeline_path and lines:
            with open(timeline_path, "a") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)


def _batch_detail(batch) -> list:
    """[forward mode, requests, of them finished] of a scheduled batch."""
    if batch is None:
        return [None, 0, 0]
    reqs = getattr(batch, "reqs", None) or []
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    return [mode, len(reqs), sum(1 for r in reqs if r.finished())]


def _traced(what, fn, detail, bound=False):
    """``fn`` with each call appended to the timeline (``detail(first
    argument, result)`` says what the call did; None: leave the call out).
    The first argument is the one after ``self``, or the first of a
    ``bound`` method. A detail that fails records the error's name, never
    raises."""
    first = 0 if bound else 1

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.time()
        result = fn(*args, **kwargs)
        t1 = time.time()
        try:
            d = detail(args[first] if len(args) > first else next(iter(kwargs.values()), None), result)
        except Exception as exc:  # a diagnostic must never take the server down
            d = [type(exc).__name__]
        if d is not None:
            _timeline.append([what, t0, t1, d])
        return result

    return wrapper


def _install_timeline(scheduler) -> None:
    from sglang.srt.managers.scheduler import Scheduler

    # (0.5.13: run_batch(self, batch), process_batch_result(self, batch, result))
    Scheduler.run_batch = _traced("run", Scheduler.run_batch, lambda b, r: _batch_detail(b))
    Scheduler.process_batch_result = _traced(
        "process", Scheduler.process_batch_result, lambda b, r: _batch_detail(b))
    try:
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

        SchedulerOutputStreamer.stream_output = _traced(
            "stream", SchedulerOutputStreamer.stream_output, lambda reqs, r: [len(reqs)] if reqs else None)
    except ImportError:
        pass
    coord = getattr(scheduler, "hisparse_coordinator", None)
    if coord is None:
        return
    # A join, a prefill's hand-over to staging, a finish: each may sync.
    for meth, what, detail in (
            ("collect_ready_reqs", "join", lambda _, r: [len(r)] if r else None),
            ("admit_request_into_staging", "stage", lambda req, r: [getattr(req, "rid", None)]),
            ("request_finished", "finish", lambda req, r: [getattr(req, "rid", None)])):
        if hasattr(coord, meth):
            setattr(coord, meth, _traced(what, getattr(coord, meth), detail, bound=True))


def _install(scheduler) -> None:
    import importlib

    for module, cls, meth in TIMED:
        try:
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, meth, _timed(f"{cls}.{meth}", getattr(owner, meth)))
        except (ImportError, AttributeError):
            pass
    coord = getattr(scheduler, "hisparse_coordinator", None)
    if coord is not None:
        for meth in COORDINATOR:
            if hasattr(coord, meth):
                setattr(coord, meth, _timed(f"coordinator.{meth}", getattr(coord, meth)))
    out = os.environ["STEPTIMER_OUT"]
    path = os.path.join(out, f"steptimer_{os.getpid()}.json")
    timeline_path = None
    if os.environ.get("STEPTIMER_TIMELINE") == "1":
        _install_timeline(scheduler)
        timeline_path = os.path.join(out, f"timeline_{os.getpid()}.jsonl")
    threading.Thread(target=_dump_forever, args=(path, timeline_path), daemon=True).start()
    if os.environ.get("STEPTIMER_PROFILE") == "1":
        _profile_scheduler_thread(os.path.join(out, f"profile_{os.getpid()}.prof"))
    if os.environ.get("STEPTIMER_SYNCS") == "1":
        _count_syncs()


def _count_syncs(depth: int = 8) -> None:
    """Count synchronizing CUDA calls by the Python stack that made them
    (torch warns on each in sync debug mode "warn"; nothing is printed)."""
    import traceback
    import warnings

    import torch

    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.endswith(("warnings.py", "hisparse_steptimer.py"))]
        stack = tuple(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}:{f.name}"
                      for f in frames[-depth:])
        with _lock:
            _syncs[stack] = _syncs.get(stack, 0) + 1

    warnings.showwarning = showwarning
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
    torch.cuda.set_sync_debug_mode("warn")


def _profile_scheduler_thread(path: str):
    """cProfile the calling (scheduler) thread while it has batches to run
    (idle loop iterations would swamp a decode step's functions); dump from
    it every 0.5 s, after a batch's results are processed (a profiler is per
    thread, so the dumping thread above cannot). A file ``profile_reset``
    beside the dump (the driver writes it after the warm-up workload) clears
    the profile and its batch count, so one-time costs stay out."""
    import cProfile

    from sglang.srt.managers.scheduler import Scheduler

    prof = cProfile.Profile()
    state = {"due": time.time() + 0.5, "batches": 0, "on": True}
    reset = os.path.join(os.path.dirname(path), "profile_reset")
    next_batch, process = Scheduler.get_next_batch_to_run, Scheduler.process_batch_result

    @functools.wraps(next_batch)
    def get_next_batch_to_run(*args, **kwargs):
        batch = next_batch(*args, **kwargs)
        if batch is None and state["on"]:
            prof.disable()
            state["on"] = False
        elif batch is not None and not state["on"]:
            prof.enable()
            state["on"] = True
        return batch

    @functools.wraps(process)
    def process_batch_result(*args, **kwargs):
        try:
            return process(*args, **kwargs)
        finally:
            state["batches"] += 1
            if time.time() >= state["due"]:
                prof.disable()
                if os.path.exists(reset):
                    os.remove(reset)
                    prof.clear()
                    state["batches"] = 0
                else:
                    prof.dump_stats(path + ".tmp")
                    os.replace(path + ".tmp", path)
                    with open(path + ".json", "w") as f:
                        json.dump({"batches": state["batches"]}, f)
                if state["on"]:
                    prof.enable()
                state["due"] = time.time() + 0.5

    Scheduler.get_next_batch_to_run = get_next_batch_to_run
    Scheduler.process_batch_result = process_batch_result
    prof.enable()
    return prof


def compare_profiles(dir_a: str, dir_b: str, top: int = 40) -> list:
    """Rows (function, A us, B us, B - A us) of own time per batch, largest
    |difference| first. Each folder holds one server's profile_*.prof and
    the batch count beside it (profile_*.prof.json)."""
    import glob
    import pstats
    import re

    def load(d):
        batches, stats = 0, {}
        for f in glob.glob(os.path.join(d, "profile_*.prof")):
            with open(f + ".json") as fh:
                batches += json.load(fh)["batches"]
            for (file, line, name), (_, _, tt, _, _) in pstats.Stats(f).stats.items():
                # Builtins carry their address: the same one differs per process.
                key = f"{os.path.basename(file)}:{line}({re.sub(' at 0x[0-9a-f]+', '', name)})"
                stats[key] = stats.get(key, 0.0) + tt
        return {k: v * 1e6 / max(batches, 1) for k, v in stats.items()}, batches

    a, na = load(dir_a)
    b, nb = load(dir_b)
    rows = [(k, a.get(k, 0.0), b.get(k, 0.0), b.get(k, 0.0) - a.get(k, 0.0)) for k in set(a) | set(b)]
    rows.sort(key=lambda r: -abs(r[3]))
    total = (sum(a.values()), sum(b.values()), sum(b.values()) - sum(a.values()))
    return [("(all functions)",) + total, ("(batches)", na, nb, nb - na)] + rows[:top]


def _main(argv) -> int:
    if len(argv) != 2:
        print("usage: hisparse_steptimer.py PROFILE_DIR_A PROFILE_DIR_B")
        return 2
    print(f"{'own time per batch, us':<70} {'A':>9} {'B':>9} {'B - A':>9}")
    for name, ta, tb, d in compare_profiles(*argv):
        print(f"{name[-70:]:<70} {ta:>9.1f} {tb:>9.1f} {d:>+9.1f}")
    return 0


def register() -> None:
    if not os.environ.get("STEPTIMER_OUT"):
        return
    from sglang.srt.managers.scheduler import Scheduler

    original = Scheduler.run_event_loop

    def run_event_loop(self, *args, **kwargs):
        try:
            _install(self)
        except Exception:  # a diagnostic must never take the server down
            import logging

            logging.getLogger(__name__).exception("step timer not installed")
        return original(self, *args, **kwargs)

    Scheduler.run_event_loop = run_event_loop


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
