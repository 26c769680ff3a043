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
]
# Methods of whatever object the scheduler holds as its HiSparse coordinator.
COORDINATOR = ["map_last_loc_to_buffer", "collect_ready_reqs", "wait_for_pending_backup",
               "has_ongoing_staging", "request_finished"]

_stats: dict = {}
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


def _dump_forever(path: str) -> None:
    while True:
        time.sleep(0.25)
        with _lock:
            snap = {k: list(v) for k, v in _stats.items()}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"time": time.time(), "stats": snap}, f)
        os.replace(tmp, path)


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
    path = os.path.join(os.environ["STEPTIMER_OUT"], f"steptimer_{os.getpid()}.json")
    threading.Thread(target=_dump_forever, args=(path,), daemon=True).start()


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
