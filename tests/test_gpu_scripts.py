"""The pure parts of the GPU scripts, on the CPU: how profile_decode.py
reads a trace, how e2e_gpu.py turns step-timer snapshots into a workload's
share and estimates a workload's limit, and the step-timer plugin itself. The next GPU session relies on
these numbers, so they are checked here rather than trusted on the device."""

import gzip
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def stage_functions(*names: str) -> str:
    """The bash text of gpu_stages.sh's functions ``names``, to run on their own."""
    import re

    text = (SCRIPTS / "gpu_stages.sh").read_text()
    return "".join(re.search(rf"^{name}\(\) \{{.*?^\}}\n", text, re.M | re.S).group(0) for name in names)


def echoing_python3(directory: Path) -> Path:
    """A ``python3`` in ``directory`` that prints its arguments instead of
    running anything (put ``directory`` first on PATH)."""
    fake = directory / "python3"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    return fake


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(path, kernels, cpu_span=(0, 4000)):
    events = [{"ph": "X", "cat": "cpu_op", "name": "step", "ts": cpu_span[0],
               "dur": cpu_span[1] - cpu_span[0], "pid": 1, "tid": 1}]
    events += [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_profile_counts_overlapping_gpu_work_once(tmp_path):
    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    # Two steps: [0, 100) and [50, 150) overlap on two streams, then [300, 400).
    assert prof.gpu_busy_us([{"ts": 0, "dur": 100}, {"ts": 50, "dur": 100},
                             {"ts": 300, "dur": 100}]) == (250.0, 400.0)
    totals = {}
    path = _trace(tmp_path / "a.trace.json.gz",
                  [("attn", 0, 100), ("swap_in", 50, 100), ("attn", 300, 100)])
    text = prof.summarize_trace(path, steps=2, totals=totals)
    assert "GPU: busy 0.125 ms/step, idle 0.075 ms/step (62% busy" in text
    assert totals["trace_ms"] == 2.0 and totals["gpu_span_ms"] == 0.2
    assert totals["kernel_ms"] == {"attn": 0.1, "swap_in": 0.05}
    other = {}
    prof.summarize_trace(_trace(tmp_path / "b.trace.json.gz", [("attn", 0, 40)]), 2,
                         totals=other)
    table = prof.side_by_side({"base": other, "ours": totals}).splitlines()
    assert table[0].split()[-2:] == ["base", "ours"]
    first_kernel = table[table.index("kernels (ms/step), largest difference first:") + 1]
    assert first_kernel.split()[0] == "attn"  # 0.02 vs 0.10 differs more than swap_in's 0 vs 0.05
    assert first_kernel.split()[1:] == ["0.0200", "0.1000"]


def test_step_timer_share_of_one_workload(tmp_path, capsys):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    out = tmp_path / "timer"
    out.mkdir()
    (out / "steptimer_1.json").write_text(json.dumps(
        {"stats": {"Scheduler.run_batch": [1.0, 100], "Scheduler.idle": [0.5, 10]}}))
    before = e2e.step_timer_snapshot(out)
    (out / "steptimer_1.json").write_text(json.dumps(
        {"stats": {"Scheduler.run_batch": [1.5, 300], "Scheduler.idle": [0.5, 10],
                   "coordinator.map_last_loc_to_buffer": [0.02, 200]}}))
    (out / "steptimer_1.json.tmp").write_text("{partial")  # a dump in progress is ignored
    diff = e2e.step_timer_diff(before, e2e.step_timer_snapshot(out))
    assert diff == {"Scheduler.run_batch": [0.5, 200],
                    "coordinator.map_last_loc_to_buffer": [0.02, 200]}
    results = {"ours": {"lone": [{"step_timer": diff}]}}
    e2e.print_step_timer(results, ["ours"], ["lone"])
    text = capsys.readouterr().out
    assert "us per scheduled batch" in text
    row = [line for line in text.splitlines() if line.startswith("coordinator.map_last_loc")][0]
    assert float(row.split()[-1]) == 100.0  # 20 ms over 200 batches


def _load_step_timer():
    sys.path.insert(0, str(SCRIPTS / "steptimer"))
    try:
        return _load("hisparse_steptimer", SCRIPTS / "steptimer" / "hisparse_steptimer.py")
    finally:
        sys.path.pop(0)


def test_step_timer_counts_synchronizing_calls_by_the_stack_that_made_them(monkeypatch):
    import warnings

    import torch

    timer = _load_step_timer()
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(timer, "_syncs", {})
    with warnings.catch_warnings():
        timer._count_syncs()

        def blocking_copy():  # what torch's "warn" mode raises on a sync
            warnings.warn("called a synchronizing CUDA operation", UserWarning)

        for _ in range(3):
            blocking_copy()
        warnings.warn("something else", UserWarning)  # passed on, not counted
    assert modes == ["warn"]
    [(stack, n)] = timer._syncs.items()
    assert n == 3 and stack[-1].endswith(":blocking_copy")


def test_step_timer_plugin_times_and_stays_off_without_its_variable(monkeypatch, tmp_path):
    timer = _load_step_timer()
    monkeypatch.delenv("STEPTIMER_OUT", raising=False)
    from sglang.srt.managers.scheduler import Scheduler

    loop = Scheduler.run_event_loop
    timer.register()
    assert Scheduler.run_event_loop is loop  # off: SGLang untouched

    calls = []
    wrapped = timer._timed("f", lambda x: calls.append(x) or x * 2)
    assert [wrapped(1), wrapped(2)] == [2, 4] and calls == [1, 2]
    assert timer._stats["f"][1] == 2 and timer._stats["f"][0] >= 0
    meta = (SCRIPTS / "steptimer" / "hisparse_steptimer-0.1.dist-info" / "entry_points.txt").read_text()
    assert "[sglang.srt.plugins]" in meta and "hisparse_steptimer:register" in meta


def test_step_timer_timeline_records_batches_and_never_raises(monkeypatch, tmp_path):
    """STEPTIMER_TIMELINE: each call becomes [what, start, end, detail] with
    wall-clock stamps (the client's share them); a scheduled batch's detail
    is its mode, size and finished count; a detail that fails is recorded,
    not raised; the dump appends only what is new."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from dataplane_fixtures import make_req

    timer = _load_step_timer()
    monkeypatch.setattr(timer, "_timeline", [])
    a, b = make_req("a", 64), make_req("b", 64)
    b.sampling_params.max_new_tokens = 1
    b.output_ids.append(5)
    b.update_finish_state()
    batch = ScheduleBatch(reqs=[a, b])

    class Owner:
        def process(self, batch, result):
            return result

    process = timer._traced("process", Owner.process, lambda bt, r: timer._batch_detail(bt))
    t = timer.time.time()
    assert process(Owner(), batch, "r") == "r"
    assert process(Owner(), batch=None, result="k") == "k"  # keywords: the first is the batch
    broken = timer._traced("join", lambda: [1], lambda _, r: r.missing, bound=True)
    assert broken() == [1]
    stage = timer._traced("stage", lambda req: None, lambda req, r: [req.rid], bound=True)
    stage(a)  # a bound method's first argument is the request
    [(w1, s1, e1, d1), (_, _, _, d2), (w3, _, _, d3), (_, _, _, d4)] = timer._timeline
    assert (w1, d1[1:], d2, w3, d3, d4) == ("process", [2, 1], [None, 0, 0], "join", ["AttributeError"], ["a"])
    assert t <= s1 <= e1 <= timer.time.time()
    lines = tmp_path / "timeline.jsonl"

    class Stop(Exception):
        pass

    def sleep(_):
        if lines.exists():  # one dump done
            raise Stop

    monkeypatch.setattr(timer.time, "sleep", sleep)
    with pytest.raises(Stop):
        timer._dump_forever(str(tmp_path / "st.json"), str(lines))
    assert [json.loads(x)[0] for x in lines.read_text().splitlines()] == ["process", "process", "join", "stage"]
    assert timer._timeline == []


def test_step_timer_timeline_wraps_what_it_names_on_the_real_classes(monkeypatch):
    """Every seam the timeline names exists: SGLang's scheduler and output
    streamer methods, and the coordinator's join, staging and finish (a
    renamed one would drop out of the timeline without a word)."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    from test_coordinator import Env

    timer = _load_step_timer()
    for owner, name in ((Scheduler, "run_batch"), (Scheduler, "process_batch_result"),
                        (SchedulerOutputStreamer, "stream_output")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    coord = Env().coord
    timer._install_timeline(SimpleNamespace(hisparse_coordinator=coord))
    wrapped = [Scheduler.run_batch, Scheduler.process_batch_result, SchedulerOutputStreamer.stream_output,
               coord.collect_ready_reqs, coord.admit_request_into_staging, coord.request_finished]
    assert all(hasattr(f, "__wrapped__") for f in wrapped)


def test_gap_timeline_reads_the_longest_gap_against_the_schedulers_sends(tmp_path):
    """A client gap of 40 ms whose tokens the scheduler sent 10 ms apart
    (the rest grew after the send) is listed first, with the scheduler's
    spacing and the slow process call inside it; short events are left out;
    both stamp formats load."""
    import lzma

    gt = _load("gap_timeline", SCRIPTS / "gap_timeline.py")
    t0 = 1000.0
    steady = {"t0": t0, "ttft": 1.0, "gaps_ms": [4.0] * 20}
    late = {"t0": t0, "ttft": 1.0, "gaps_ms": [4.0] * 10 + [40.0] + [4.0] * 9}
    # the scheduler streams every 4 ms, once 10 ms apart, just before late's gap
    sends, t = [], t0 + 1.0 - 0.001
    for k in range(21):
        t += 0.010 if k == 10 else 0.004
        sends.append(["stream", t - 0.0005, t, [2]])
    timeline = sends + [["process", t0 + 1.036, t0 + 1.045, ["DECODE", 2, 1]],
                        ["run", t0 + 1.030, t0 + 1.032, ["DECODE", 2, 0]]]
    lines = gt.report([steady, late], sorted(timeline, key=lambda e: e[1]), top=2, min_ms=5.0)
    assert lines[0].startswith("req  1 token    11") and "gap    40.0 ms (  10.0x" in lines[0]
    assert "longest spacing 10.0 ms" in lines[0]
    assert [x.split()[0] for x in lines[1:3]] == ["process", "req"]  # the 2 ms run is left out
    (tmp_path / "stamps.json.xz").write_bytes(lzma.compress(json.dumps({"hold": [late]}).encode()))
    assert gt.load_requests(str(tmp_path / "stamps.json.xz"), "hold") == [late]
    bound = {"runs": {"ours": {"decodebound": [{"requests": [steady]}]}}}
    (tmp_path / "bound.json").write_text(json.dumps(bound))
    assert gt.load_requests(str(tmp_path / "bound.json"), "ours") == [steady]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(e) + "\n" for e in reversed(timeline)))
    assert gt.load_timeline(str(tmp_path / "t.jsonl"))[0] == sends[0]


def _spin(n):
    total = 0
    for i in range(n):  # own time, not a builtin's
        total += i
    return total


def _own_calls(prof_path, func):
    """Calls of ``func`` a pstats dump recorded (counted, not timed)."""
    import pstats

    return sum(nc for (_, _, name), (_, nc, _, _, _) in pstats.Stats(str(prof_path)).stats.items()
               if name == func)


def test_step_profile_dumps_from_the_scheduler_thread(monkeypatch, tmp_path):
    # The profile covers the batches after the reset, and only while the
    # scheduler has batches: neither the warm-up nor an idle spin is in it.
    # Checked by call counts and the batch count beside the dump, never by
    # time (what the profiler's clock says on a shared box decides nothing).
    timer = _load_step_timer()
    from sglang.srt.managers.scheduler import Scheduler

    def one_config(name, extra):
        out = tmp_path / name
        out.mkdir()
        monkeypatch.setattr(Scheduler, "process_batch_result", lambda self: None)
        monkeypatch.setattr(Scheduler, "get_next_batch_to_run", lambda self: self)
        clock = [0.0]
        monkeypatch.setattr(timer.time, "time", lambda: clock[0])
        prof = timer._profile_scheduler_thread(str(out / "profile_1.prof"))
        try:
            _spin(3)  # warm-up: cleared by the reset below
            (out / "profile_reset").touch()
            clock[0] = 1.0
            Scheduler.process_batch_result(None)
            assert not (out / "profile_reset").exists()
            for _ in range(10):
                Scheduler.get_next_batch_to_run(1)
                _spin(10)
                if extra:
                    _spin(20)
                Scheduler.process_batch_result(None)
            Scheduler.get_next_batch_to_run(None)  # idle: not profiled
            _spin(5)
            clock[0] = 2.0
            Scheduler.get_next_batch_to_run(1)
            Scheduler.process_batch_result(None)
        finally:
            prof.disable()
            monkeypatch.undo()
        return out

    a, b = one_config("a", False), one_config("b", True)
    for out, calls in ((a, 10), (b, 20)):
        assert json.loads((out / "profile_1.prof.json").read_text()) == {"batches": 11}
        assert _own_calls(out / "profile_1.prof", "_spin") == calls
    rows = timer.compare_profiles(str(a), str(b))
    assert rows[1] == ("(batches)", 11, 11, 0)
    assert any("(_spin)" in row[0] for row in rows[2:])


def _write_profile(path, own_seconds, batches):
    """A pstats dump with the given own time per function, and its batch count."""
    import marshal

    stats = {key: (1, 1, tt, tt, {}) for key, tt in own_seconds.items()}
    path.write_bytes(marshal.dumps(stats))
    Path(str(path) + ".json").write_text(json.dumps({"batches": batches}))


def test_compare_profiles_per_batch_arithmetic(tmp_path):
    # Own time per batch, summed over a folder's dumps (one per scheduler
    # process), builtins matched across processes without their address,
    # largest |B - A| first: synthetic dumps, exact numbers.
    timer = _load_step_timer()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    spin = ("/x/steps.py", 7, "_spin")
    sort_a = ("~", 0, "<method 'sort' of 'list' objects at 0x7f00aa>")
    sort_b = ("~", 0, "<method 'sort' of 'list' objects at 0x7f11bb>")
    only_b = ("/x/coord.py", 30, "map_last_loc_to_buffer")
    _write_profile(a / "profile_1.prof", {spin: 0.010, sort_a: 0.004}, 10)
    _write_profile(a / "profile_2.prof", {spin: 0.010}, 10)
    _write_profile(b / "profile_1.prof", {spin: 0.020, sort_b: 0.002, only_b: 0.050}, 25)
    rows = timer.compare_profiles(str(a), str(b))

    def us(row):
        return tuple(round(x, 6) for x in row[1:])

    assert rows[1] == ("(batches)", 20, 25, 5)
    assert us(rows[0]) == (1200.0, 2880.0, 1680.0)  # all functions, us per batch
    body = {r[0]: us(r) for r in rows[2:]}
    assert body == {
        "coord.py:30(map_last_loc_to_buffer)": (0.0, 2000.0, 2000.0),
        "steps.py:7(_spin)": (1000.0, 800.0, -200.0),
        "~:0(<method 'sort' of 'list' objects>)": (200.0, 80.0, -120.0),
    }
    assert [r[0] for r in rows[2:]] == list(body)  # largest difference first


def test_busiest_threads_scales_by_the_real_interval(monkeypatch):
    # Synthetic /proc snapshots and clock: reading each snapshot took 1 s and
    # the sleep 0.5 s, so the interval between the snapshots' midpoints is
    # 1.5 s; a thread that used 1.5 s of CPU in it ran one whole core.
    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    hz = os.sysconf("SC_CLK_TCK")
    before = {(10, 10): ("python", "spin", 3, 100), (10, 11): ("python", "idle", 0, 50),
              (20, 20): ("sglang", "sched", 1, 0)}
    after = {(10, 10): ("python", "spin", 5, 100 + int(1.5 * hz)),
             (10, 11): ("python", "idle", 0, 50),
             (20, 20): ("sglang", "sched", 1, int(0.75 * hz)),
             (30, 30): ("new", "born", 2, 7)}  # started in between: no earlier reading
    snapshots = iter([before, after])
    monkeypatch.setattr(prof, "thread_cpu_times", lambda: next(snapshots))
    clock = iter([0.0, 1.0, 1.5, 2.5])
    monkeypatch.setattr(prof.time, "monotonic", lambda: next(clock))
    slept = []
    monkeypatch.setattr(prof.time, "sleep", slept.append)
    text = prof.busiest_threads(0.5).splitlines()
    assert slept == [0.5]
    assert text[0].startswith("busiest threads over 1.5 s")
    rows = [line.split() for line in text[1:]]
    # (share of a core, pid, tid, last core)
    assert [(r[0], r[2], r[4], r[6]) for r in rows] == [("100.0%", "10", "10", "5"),
                                                        ("50.0%", "20", "20", "1")]


class _LogClock:
    """A fake clock for profile_decode's waits: ``time.sleep`` advances it
    and appends to the server log the lines whose time has come
    (``{t: line}``)."""

    def __init__(self, log: Path, lines: dict):
        self.log, self.lines, self.now = log, dict(lines), 0.0
        log.write_text("")
        self.sleep(0)

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        due = sorted(t for t in self.lines if t <= self.now)
        with self.log.open("a") as f:
            for t in due:
                f.write(self.lines.pop(t) + "\n")


def _running_line(running):
    return (f"[t] Decode batch, #running-req: {running}, #gpu token: 1, "
            "gen throughput (token/s): 100.0, #queue-req: 6")


@pytest.mark.parametrize("case", ["all", "plateau", "prefills", "timeout"])
def test_profile_waits_for_every_request_or_for_the_running_count_to_stop_growing(
        tmp_path, monkeypatch, case):
    # A pool that holds 10 of 16 prompts (SGLang's native HiSparse at 32K):
    # waiting for 16 would spend the whole join timeout. The wait ends 20 s
    # after the count last grew, unless a prefill (a prompt still being
    # admitted) is logged meanwhile.
    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    log = tmp_path / "server.log"
    lines = {float(t): _running_line(r) for t, r in ((5, 4), (10, 8), (15, 10), (30, 10), (45, 10))}
    if case == "all":
        lines[30.0] = _running_line(16)
    if case == "prefills":  # the next prompts prefill while the count stays at 10
        lines.update({25.0: "[t] Prefill batch, #new-seq: 1", 40.0: "[t] Prefill batch, #new-seq: 1"})
    clock = _LogClock(log, lines)
    monkeypatch.setattr(prof.time, "time", clock.time)
    monkeypatch.setattr(prof.time, "sleep", clock.sleep)
    timeout = 30.0 if case == "timeout" else 300.0
    waited, running = prof.wait_all_running(log, 16, timeout, 20.0 if case != "timeout" else 60.0)
    want = {"all": (30.0, 16), "plateau": (35.0, 10), "prefills": (60.0, 10), "timeout": (30.0, 10)}[case]
    assert (round(waited), running) == want


@pytest.mark.parametrize("end_after_profile", [True, False])
def test_end_after_profile_stops_the_server_under_unfinished_requests(
        tmp_path, monkeypatch, end_after_profile):
    # Requests long enough to outlast a slow fill: with --end-after-profile
    # the server stops once the trace is written and the streams end with
    # it; without, the script waits for every request to finish.
    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    e2e = prof.e2e_gpu
    stopped, ended_by_stop = threading.Event(), []

    class LauncherStub:  # e2e_gpu.Server, this script's own launcher
        url = "http://stub"

        def __init__(self, model, port, config, extra, log, **kwargs):
            log.write_text(_running_line(2) + "\n")

        def wait_ready(self):
            return 0.0

        def stop(self):
            stopped.set()

    def stream(url, ids, max_new):  # read_stream: raw events, parsed by the script afterwards
        ended_by_stop.append(stopped.wait(3))  # False: it "finished" on its own
        if ended_by_stop[-1]:
            raise ConnectionResetError("the server stopped")
        return {"prompt_len": len(ids), "t0": 0.0, "stamps": [0.5, 0.501, 0.502],
                "events": [b'data: {"output_ids": [%d], "meta_info": {}}' % k for k in range(3)]}

    def start_profile(url, body):
        _trace(Path(body["output_dir"]) / "p.trace.json.gz", [("gemm", 0, 100)])

    monkeypatch.setattr(e2e, "Server", LauncherStub)
    gap_inputs, gap_stats = [], e2e.gap_stats
    monkeypatch.setattr(e2e, "read_stream", stream)
    monkeypatch.setattr(e2e, "gap_stats", lambda rs: gap_inputs.append(rs) or gap_stats(rs))
    monkeypatch.setattr(e2e, "exit_on_sigterm", lambda: None)
    monkeypatch.setattr(prof, "post", start_profile)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    waits, wait_all_running = [], prof.wait_all_running
    monkeypatch.setattr(prof, "wait_all_running", lambda log, reqs, timeout_s, plateau_s:
                        waits.append((timeout_s, plateau_s)) or wait_all_running(log, reqs, timeout_s, plateau_s))
    flags = ["--end-after-profile", "0.1"] if end_after_profile else []
    rc = prof.main(["--configs", "native:2:plateau=7:join=9", "--warm-s", "0", "--steps", "1", "--no-stack",
                    "--model", str(tmp_path), "--out", str(tmp_path / "out"), *flags])
    assert rc == 0 and (tmp_path / "out" / "profile_native_2x16000.txt").exists()
    assert waits == [(9.0, 7.0)]  # the configuration's own waits, not --join-timeout-s / --plateau-s
    assert ended_by_stop == [end_after_profile] * 2
    # The streams that finished reach the gap figures parsed; the ones the
    # stop cut are not counted.
    (measured,) = gap_inputs
    assert [r["output_ids"] for r in measured] == ([] if end_after_profile else [[0, 1, 2]] * 2)


def test_each_configuration_waits_for_its_running_count_as_its_spec_says(tmp_path, monkeypatch):
    # At 61 layers native, ours and base need different waits (-s8: native
    # a 300 s plateau and a 130 s join bound, ours 20 s, base 15 s / 60 s):
    # per-configuration waits let them share one device command.
    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    calls = []
    monkeypatch.setattr(prof, "profile_one", lambda args, config, totals, reqs, **waits:
                        calls.append((config, reqs, waits)) or 0)
    monkeypatch.setattr(prof.e2e_gpu, "exit_on_sigterm", lambda: None)
    argv = ["--model", str(tmp_path), "--out", str(tmp_path / "out"), "--plateau-s", "20",
            "--join-timeout-s", "300"]
    assert prof.main(["--configs", "native:16:plateau=300:join=130,ours:16,base:2:join=60:plateau=15",
                      *argv]) == 0
    assert calls == [("native", 16, {"plateau_s": 300.0, "join_timeout_s": 130.0}),
                     ("ours", 16, {"plateau_s": 20.0, "join_timeout_s": 300.0}),
                     ("base", 2, {"plateau_s": 15.0, "join_timeout_s": 60.0})]
    calls.clear()
    for bad in ("ours:0", "ours:plateau=", "ours:wait=3", "ours:join=-1", "ourz:16", "ours:16:2x"):
        with pytest.raises(SystemExit):
            prof.main(["--configs", f"base:2,{bad}", *argv])
    assert calls == []  # refused before any server starts
    with pytest.raises(ValueError, match="--configs: 'wait=3' in 'ours:wait=3'.*plateau=S or join=S"):
        prof.parse_config_spec("ours:wait=3", prof.argparse.Namespace(reqs=1, plateau_s=20.0,
                                                                       join_timeout_s=300.0))


def test_thread_cpu_times_lists_every_thread_of_a_process():
    # The /proc reader on this machine: this process and each of its
    # threads, by (pid, tid), with its name and tick counts.
    import threading

    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        times = prof.thread_cpu_times()
    finally:
        stop.set()
        worker.join()
    mine = {tid: v for (pid, tid), v in times.items() if pid == os.getpid()}
    assert os.getpid() in mine and worker.native_id in mine
    comm = Path("/proc/self/comm").read_text().strip()
    assert {v[0] for v in mine.values()} == {comm}
    assert all(isinstance(v[3], int) and v[3] >= 0 for v in mine.values())


def test_core_probe_and_sigterm_cleanup(tmp_path):
    import subprocess

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    speeds = e2e.cpu_core_speeds(loops=20_000)
    assert speeds and all(t > 0 for t in speeds.values())
    assert "slowest / fastest = " in e2e.describe_core_speeds(speeds)
    assert e2e.describe_core_speeds({0: 0.2, 1: 0.38}).endswith("0:200 1:380; slowest / fastest = 1.90")

    fastest = e2e.choose_cpus("fastest:1", {0: 0.3, 1: 0.2})
    assert fastest == {1}
    assert e2e.choose_cpus("0", speeds) == {0}
    for bad in ("fastest:0", "fastest:3", "", "9999"):
        try:
            e2e.choose_cpus(bad, {0: 0.3, 1: 0.2})
        except ValueError as exc:
            assert "--cpus" in str(exc)
        else:
            raise AssertionError(f"--cpus {bad!r} was accepted")
    pinned = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                            capture_output=True, text=True, preexec_fn=e2e.pin_to({0}), check=True)
    assert pinned.stdout.strip() == "[0]"

    # SIGTERM (what `timeout` sends) must run the finally blocks that stop
    # the servers; a server left behind spoils every later launch.
    marker = tmp_path / "stopped"
    script = tmp_path / "victim.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(SCRIPTS)!r})\n"
        "import e2e_gpu\n"
        "e2e_gpu.exit_on_sigterm()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        f"    open({str(marker)!r}, 'w').write('yes')\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    assert marker.read_text() == "yes"

    # The handler itself signals every live server's group before the
    # finally blocks run: a 'server' (its own session, as Server starts
    # one) that nothing else stops exits with the script.
    script.write_text(
        "import subprocess, sys, time\n"
        f"sys.path.insert(0, {str(SCRIPTS)!r})\n"
        "import e2e_gpu\n"
        "e2e_gpu.exit_on_sigterm()\n"
        "server = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "                          start_new_session=True)\n"
        "e2e_gpu.LIVE_SERVER_GROUPS.add(server.pid)\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server = int(proc.stdout.readline())
    try:
        proc.terminate()
        assert proc.wait(timeout=30) == 143
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        # It may linger as a zombie of init until reaped: its state says.
        state = Path(f"/proc/{server}/stat")
        assert not state.exists() or state.read_text().split(") ")[1][0] == "Z", "server outlived SIGTERM"
    finally:
        try:
            os.killpg(server, 9)
        except ProcessLookupError:
            pass


def test_workload_limit_and_each_configs_share_of_it(capsys):
    # 4 prompts of which the first prefilled alone in 0.1 s; base decodes at
    # 2 ms a step: no scheduler finishes 4 x 10 tokens sooner than
    # 4 x 0.1 s + 9 x 2 ms = 0.418 s, i.e. 40 / 0.418 = 95.7 tok/s.
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    e2e.WORKLOADS["tiny"] = ([[100] * 4], 10, [])

    def run(tok_s, ttfts):
        reqs = [{"ttft": t, "output_ids": [1] * 10, "top2": [], "logprobs": []} for t in ttfts]
        return {"requests": reqs, "errors": [], "output_tok_s": tok_s, "decode_step_ms": 2.0}

    limit = e2e.workload_limit([run(50.0, [0.3, 0.1, 0.2, 0.4])], 10)
    assert abs(limit["wall_s"] - 0.418) < 1e-9 and limit["prompts"] == 4
    results = {"base": {"tiny": [run(50.0, [0.3, 0.1, 0.2, 0.4])]},
               "ours": {"tiny": [run(80.0, [0.1, 0.2, 0.3, 0.4])]}}
    rows = e2e.summarize(results, ["base", "ours"], ["tiny"], 0.05, 0.05)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("tiny        limit   ~95.7 tok/s (x1.91 base) = 4 prefills x 0.100 s (first TTFT)")
    assert line.endswith("share of it: base 0.52, ours 0.84")
    assert rows[-1]["config"] == "limit" and abs(rows[1]["tok_s_vs_limit"] - 80 / (40 / 0.418)) < 1e-9


def test_the_limit_takes_the_prefill_from_the_server_log_over_a_cold_first_ttft(tmp_path):
    # 2026-12-06-s5: base's first decodelong request built the kernels
    # (TTFT 10.3 s, warm 0.6 s), and the TTFT-based limit came out at 0.93x
    # base's own rate. The log's prefill lines give the warm rate: the cold
    # chunk, and the first chunk of a burst (its interval held decode steps),
    # are outliers the median leaves out.
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    rates = [694.0, 57114.5, 17838.5, 26832.8, 63797.2, 55954.1, 47160.8, 60702.5,
             427.5, 57065.7, 52027.4, 49639.6, 60635.9, 53595.6, 48235.1, 52852.0]
    lines = ["[t] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 0, "
             "input throughput (token/s): 8.69"]  # the warm-up request: too short to count
    lines += [f"[t] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.2, "
              f"#running-req: 0, cuda graph: False, input throughput (token/s): {r}" for r in rates]
    log = tmp_path / "base.log"
    log.write_text("\n".join(lines) + "\n")
    rate = e2e.log_stats(log, 0)["prefill_tok_s"]
    assert rate == statistics.median(rates) and 52000 < rate < 54000
    reqs = [{"ttft": 10.3 + 30 * k, "prompt_len": 32000, "output_ids": [1] * 10} for k in range(4)]
    limit = e2e.workload_limit([{"requests": reqs, "decode_step_ms": 3.1, "prefill_tok_s": rate}], 10)
    assert limit["prefill_from"] == "server prefill rate"
    assert abs(limit["prefill_s"] - 32000 / rate) < 1e-12 and limit["prefill_s"] < 0.62
    assert abs(limit["wall_s"] - (4 * 32000 / rate + 9 * 3.1e-3)) < 1e-9
    # without the log's rate, the cold TTFT is all there is
    reqs_only = e2e.workload_limit([{"requests": reqs, "decode_step_ms": 3.1}], 10)
    assert reqs_only["prefill_from"] == "first TTFT" and reqs_only["prefill_s"] == 10.3


# --- model_config.py, e2e's --ref-pkg and --check (appended) ---

DATA = Path(__file__).resolve().parent / "data"


def test_model_config_writes_the_v32_geometry_and_sglang_reads_it(tmp_path):
    mc = _load("model_config", SCRIPTS / "model_config.py")
    assert mc.main(["--geometry", "v32", "--layers", "61", "--out", str(tmp_path / "v32")]) == 0
    cfg = json.loads((tmp_path / "v32" / "config.json").read_text())
    assert cfg == json.loads((DATA / "dsv32-geometry" / "config.json").read_text())
    expect = {"hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
              "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
              "num_hidden_layers": 61, "first_k_dense_replace": 61, "intermediate_size": 2048}
    assert {k: cfg[k] for k in expect} == expect
    # Everything else is the kit's tiny config.
    tiny = json.loads((DATA / "tiny-dsv32" / "config.json").read_text())
    changed = {k for k in tiny if tiny[k] != cfg[k]}
    assert changed == {"hidden_size", "num_attention_heads", "num_key_value_heads",
                       "num_hidden_layers", "first_k_dense_replace"}
    assert set(cfg) == set(tiny)
    est = mc.estimate(cfg)
    assert 15e9 < est["params"] < 16e9  # ~31 GB of bf16 weights
    assert est["kv_bytes_per_token"] == 61 * (2 * 576 + 132)

    short = mc.build_config("v32", 3)
    assert short["num_hidden_layers"] == short["first_k_dense_replace"] == 3
    for bad in (("v4", None), ("v32", 0)):
        try:
            mc.build_config(*bad)
        except ValueError as exc:
            assert "--geometry" in str(exc) or "--layers" in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")

    # SGLang 0.5.13's own reader: DSA architecture, MLA, all layers dense.
    from sglang.srt.configs.model_config import (
        ModelConfig, get_dsa_index_head_dim, get_dsa_index_n_heads, get_dsa_index_topk,
        is_deepseek_dsa)

    m = ModelConfig(str(tmp_path / "v32"))
    hf = m.hf_config
    assert is_deepseek_dsa(hf) and hf.architectures == ["DeepseekV32ForCausalLM"]
    assert (m.num_hidden_layers, m.kv_lora_rank, m.qk_rope_head_dim) == (61, 512, 64)
    assert (get_dsa_index_n_heads(hf), get_dsa_index_head_dim(hf), get_dsa_index_topk(hf)) == \
        (64, 128, 2048)
    assert hf.hidden_size == 7168 and hf.num_attention_heads == 128
    dense = [i for i in range(hf.num_hidden_layers)
             if not (hf.n_routed_experts is not None and i >= hf.first_k_dense_replace
                     and i % hf.moe_layer_freq == 0)]  # deepseek_v2.py's MoE test
    assert len(dense) == 61


def test_model_config_tiny_reproduces_the_kit_config(tmp_path):
    mc = _load("model_config", SCRIPTS / "model_config.py")
    kit = json.loads((DATA / "tiny-dsv32" / "config.json").read_text())
    assert mc.build_config("tiny") == kit
    six = mc.build_config("tiny", 6)
    assert six["num_hidden_layers"] == six["first_k_dense_replace"] == 6
    assert {k: v for k, v in six.items() if kit[k] != v}.keys() == {"num_hidden_layers",
                                                                      "first_k_dense_replace"}
    kit_copy = Path(__file__).resolve().parents[1] / ".gpu" / "tiny-dsv32" / "config.json"
    if kit_copy.exists():  # the kit is git-ignored; CI has only tests/data
        assert json.loads(kit_copy.read_text()) == kit


def _decode_line(running, misses, checked=None, mismatch=None):
    exact = (f", #exact checked: {checked}, #exact mismatch: {mismatch}"
             if checked is not None else "")
    return (f"[2026-12-01 10:00:00 TP0] Decode batch, #running-req: {running}, #token: 9000, "
            f"token usage: 0.10, hisparse hit rate: 0.612, #hisparse miss: {misses}, "
            f"host read: 12.5 MiB{exact}, cuda graph: True, gen throughput (token/s): 800.00, "
            f"#queue-req: 0\n")


def test_exactness_counters_from_the_decode_log_and_their_verdicts(tmp_path, capsys):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    log = tmp_path / "server.log"
    log.write_text(_decode_line(16, 0, 0, 0) + _decode_line(16, 5000, 120, 0)
                   + _decode_line(4, 9000, 480, 0))
    st = e2e.log_stats(log, 0)
    assert (st["exact_checked"], st["exact_mismatch"], st["exact_first_mismatch"]) == (480, 0, None)
    assert st["hisparse_misses"] == 9000 and st["max_running"] == 16
    assert st["decode_step_ms"] == 16 * 1000 / 800  # the appended field leaves the rate readable
    assert e2e.check_verdict("ours", st) == {"expect": "exact", "verdict": "exact",
                                             "check_ok": True, "host_misses_seen": True}
    assert e2e.check_verdict("noio", st)["verdict"] == "MISSED"
    assert e2e.check_verdict("ref", st)["check_ok"] is None  # another package: not judged
    assert st["tracebacks"] == 0
    assert st["join_wait_mean_ms"] is None  # a log without the field (base, or an older ours)
    joined = tmp_path / "joined.log"
    joined.write_text(_decode_line(4, 0).replace(", cuda graph", ", join wait mean/max: 3.2/35.0 ms, cuda graph")
                      + _decode_line(4, 0).replace(", cuda graph", ", join wait mean/max: 4.5/41.5 ms, cuda graph"))
    got = e2e.log_stats(joined, 0)
    assert (got["join_wait_mean_ms"], got["join_wait_max_ms"]) == (4.5, 41.5)  # the last line: the launch so far
    assert got["decode_step_ms"] == 4 * 1000 / 800  # the rate stays readable
    assert got["retracted_reqs"] == 0
    with joined.open("a") as f:  # 0.5.13's line (scheduler.update_running_batch), twice
        for n in (1, 2):
            f.write(f"[2026-12-06 20:54:27] KV cache pool is full. Retract requests. "
                    f"#retracted_reqs: {n}, #new_tokens_gained: 4160, #new_token_ratio: 0.0980 -> 0.5564\n")
    assert e2e.log_stats(joined, 0)["retracted_reqs"] == 3

    # 0.5.13's start-up traceback (openai_harmony missing) is benign; any other fails "exact".
    benign = ("[2026-12-01 09:59:59] Can not initialize OpenAIServingResponses, error: "
              "Traceback (most recent call last):\nModuleNotFoundError: No module named "
              "'openai_harmony'\n")
    raised = "Traceback (most recent call last):\nRuntimeError: CUDA error\n"
    started = tmp_path / "started.log"
    started.write_text(benign + log.read_text())
    assert e2e.log_stats(started, 0)["tracebacks"] == 0
    assert e2e.check_verdict("ours", e2e.log_stats(started, 0))["verdict"] == "exact"
    started.write_text(benign + log.read_text() + raised)
    assert e2e.log_stats(started, 0)["tracebacks"] == 1
    assert e2e.check_verdict("ours", e2e.log_stats(started, 0)) == {
        "expect": "exact", "verdict": "TRACEBACK", "check_ok": False, "host_misses_seen": True}

    mark = log.stat().st_size
    with log.open("a") as f:
        f.write("[2026-12-01 10:00:01 TP0] ERROR HiSparse exactness check: first mismatch: "
                "req 3 layer 0 logical 8123 row 77\n")
        f.write(_decode_line(16, 12000, 900, 35))
    seg = e2e.log_stats(log, mark)
    assert (seg["exact_checked"], seg["exact_mismatch"]) == (900, 35)
    assert seg["exact_first_mismatch"].startswith("HiSparse exactness check: first mismatch: req 3")
    assert e2e.check_verdict("noio", seg)["verdict"] == "caught"
    assert e2e.check_verdict("ours", seg)["verdict"] == "MISMATCH"
    # A line alone (counters not printed yet) is still a mismatch.
    only_line = dict(seg, exact_mismatch=0)
    assert e2e.check_verdict("ours", only_line)["check_ok"] is False

    # No counters at all: the check did not run, which must not pass.
    plain = tmp_path / "plain.log"
    plain.write_text(_decode_line(1, 0))
    none = e2e.log_stats(plain, 0)
    assert none["exact_checked"] is None
    assert e2e.check_verdict("ours", none) == {"expect": "exact", "verdict": "NOT CHECKED",
                                               "check_ok": False, "host_misses_seen": False}

    launches = [dict(config="ours", rep=0, workloads=["concurrent"], check=True, **st,
                     **e2e.check_verdict("ours", st)),
                dict(config="noio", rep=0, workloads=["concurrent"], check=True, **seg,
                     **e2e.check_verdict("noio", seg)),
                dict(config="base", rep=0, workloads=["concurrent"], check=False)]
    rows = e2e.summarize_checks(launches)
    assert [r["config"] for r in rows] == ["ours", "noio"]
    text = capsys.readouterr().out.splitlines()
    assert text[1].startswith("exactness check (SGLANG_HISPARSE_CHECK=1")
    ours = text[3].split()
    assert ours[:5] == ["ours", "0", "concurrent", "480", "0"] and ours[-2:] == ["9000", "exact"]
    noio = text[4].split()
    assert noio[3:6] == ["900", "35", "yes"] and noio[-1] == "caught"
    assert text[5].strip().startswith("HiSparse exactness check: first mismatch")


def test_ref_config_runs_the_other_package_and_check_reaches_hisparse_servers(tmp_path, monkeypatch):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    ours, ref, other = tmp_path / "proj", tmp_path / "ref", tmp_path / "site"
    for d in (ours, ref):
        (d / "sglang_hisparse").mkdir(parents=True)
        (d / "sglang_hisparse" / "__init__.py").write_text("")
        (d / "sglang_hisparse-0.1.0.dist-info").mkdir()
        (d / "sglang_hisparse-0.1.0.dist-info" / "entry_points.txt").write_text(
            "[sglang.srt.plugins]\nsglang_hisparse = sglang_hisparse.plugin:register\n")
    other.mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{ours}:{other}")
    monkeypatch.delenv(e2e.CHECK_ENV, raising=False)
    assert e2e.check_ref_pkg(str(ref)) == str(ref.resolve())
    for bad in (other, tmp_path / "missing"):
        try:
            e2e.check_ref_pkg(str(bad))
        except ValueError as exc:
            assert "--ref-pkg" in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")

    cmd, env = e2e.server_cmd("/m", 1, "ref", ["--max-total-tokens", "40000"], ref_pkg=str(ref),
                              check=True, server_args=["--mem-fraction-static", "0.45"])
    assert env["PYTHONPATH"].split(":") == [str(ref), str(other)]
    assert env[e2e.CHECK_ENV] == "1" and "--enable-hisparse" in cmd
    assert cmd.count("--max-total-tokens") == 1
    assert cmd[cmd.index("--mem-fraction-static", cmd.index("40000")) + 1] == "0.45"  # the last wins
    _, env = e2e.server_cmd("/m", 1, "ours", [], check=True,
                            hs_config={"top_k": 2048, "device_buffer_size": 4096,
                                       "host_to_device_ratio": 2})
    assert env["PYTHONPATH"] == f"{ours}:{other}" and env[e2e.CHECK_ENV] == "1"
    cmd, env = e2e.server_cmd("/m", 1, "base", [], check=True)
    assert e2e.CHECK_ENV not in env and "--enable-hisparse" not in cmd
    cmd, _ = e2e.server_cmd("/m", 1, "ours", [], hs_config={"host_to_device_ratio": 2})
    assert json.loads(cmd[cmd.index("--hisparse-config") + 1]) == {"host_to_device_ratio": 2}
    for cfg, kw in (("ours2", {}), ("ref", {})):
        try:
            e2e.server_cmd("/m", 1, cfg, [], **kw)
        except ValueError as exc:
            assert cfg in str(exc) or "--ref-pkg" in str(exc)
        else:
            raise AssertionError(f"{cfg} was accepted")

    # What the server would import, seen from the servers' empty directory.
    _, env = e2e.server_cmd("/m", 1, "ref", [], ref_pkg=str(ref))
    origin = e2e.package_origin(env)
    assert origin["origin"] == str(ref / "sglang_hisparse" / "__init__.py")
    assert origin["entry_point"] == "sglang_hisparse.plugin:register"
    assert not any(Path(e2e.server_cwd()).iterdir())


def test_merge_keeps_each_rounds_check_launches(tmp_path, capsys):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    # recorded before the first-gap statistic existed: merge takes it from the requests
    run = {"requests": [{"ttft": 0.1, "output_ids": [1, 2, 3], "top2": [], "logprobs": [],
                         "gaps_ms": [30.0, 2.0]}],
           "errors": [], "output_tok_s": 10.0, "mean_tpot_ms": 2.0, "decode_step_ms": 2.0}
    paths = []
    for i, (cfg, checked) in enumerate((("ref", None), ("ours", 64))):
        launch = {"config": cfg, "rep": 0, "workloads": ["lone"], "check": True,
                  "exact_checked": checked, "exact_mismatch": 0 if checked else None,
                  "exact_first_mismatch": None, "hisparse_misses": 10}
        launch.update(e2e.check_verdict(cfg, launch))
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps({"runs": {"base": {"lone": [run]}, cfg: {"lone": [run]}},
                                 "launches": [launch]}))
        paths.append(str(p))
    out = tmp_path / "merged.json"

    class Args:
        merge, margin, tol = paths, 0.05, 0.05

    Args.out = str(out)
    assert e2e.merge(Args) == 0
    merged = json.loads(out.read_text())
    assert [x["config"] for x in merged["launches"]] == ["ref", "ours"]
    assert [x["verdict"] for x in merged["checks"]] == ["n/a", "exact"]
    rows = {r["config"]: r for r in merged["summary"] if r["workload"] == "lone"}
    assert list(rows) == ["base", "ref", "ours", "limit"]
    assert rows["ours"]["tok_s_vs_ref"] == 1.0 and rows["ours"]["exactness_vs_ref"]["violations"] == 0
    gaps = {r["config"]: r for r in merged["decode"] if r["workload"] == "lone"}
    assert gaps["ours"]["itg_first_p50_ms"] == 30.0
    out = capsys.readouterr().out
    assert "x1.00 ref" in out
    assert "mtp target" not in out  # no request of these runs speculated


def test_merge_compares_no_synthetic_top_k_run_with_base(tmp_path, capsys):
    # A synthetic top-k's outputs are not the model's: merge must leave them
    # uncompared, as a live run does, or every such table shows mismatches.
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    run = {"requests": [{"ttft": 0.1, "output_ids": [1, 2, 3], "top2": [], "logprobs": [],
                         "gaps_ms": [3.0, 2.0]}],
           "errors": [], "output_tok_s": 10.0, "mean_tpot_ms": 2.0, "decode_step_ms": 2.0}
    rows = {}
    for synthetic in ("calibrated", None):
        p = tmp_path / f"{synthetic}.json"
        p.write_text(json.dumps({"env": {"synthetic": synthetic},
                                 "runs": {"base": {"lone": [run]}, "ours": {"lone": [run]}}}))

        class Args:
            merge, margin, tol, out = [str(p)], 0.05, 0.05, str(tmp_path / "merged.json")

        assert e2e.merge(Args) == 0
        merged = json.loads(Path(Args.out).read_text())
        rows[synthetic] = {r["config"]: r for r in merged["summary"] if r["workload"] == "lone"}
    capsys.readouterr()
    assert "exactness" not in rows["calibrated"]["ours"]
    assert rows[None]["ours"]["exactness"]["violations"] == 0


def test_decode_only_rate_skips_intervals_with_prefill():
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    line = "[t] Decode batch, #running-req: {}, #gpu token: 1, gen throughput (token/s): {}, #queue-req: 0"
    log = "\n".join([
        "[t] Prefill batch, #new-seq: 1, #new-token: 64",
        line.format(8, 100.0),  # its interval held a prefill
        line.format(8, 800.0),
        "[t] Prefill batch, #new-seq: 1, #new-token: 64",
        line.format(9, 50.0),  # the highest count, but after a prefill
        line.format(8, 900.0),
        line.format(8, 700.0),
        line.format(2, 300.0),
    ])
    got = e2e.decode_only(log)
    assert got == {"decode_only_tok_s": 800.0, "decode_only_running": 8, "decode_only_lines": 3}
    assert e2e.decode_only("no decode lines")["decode_only_tok_s"] is None


def test_gap_stats_finds_the_stalled_stream():
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    steady = {"gaps_ms": [10.0] * 99}
    parked = {"gaps_ms": [10.0] * 10 + [900.0] + [10.0] * 10}  # waited after its first tokens
    got = e2e.gap_stats([steady, parked])
    assert got["itg_p50_ms"] == 10.0 and got["itg_p99_ms"] == 10.0
    assert got["itg_worst_over_median"] == 90.0
    assert got["itg_first_p50_ms"] == 10.0
    late = {"gaps_ms": [40.0] + [10.0] * 20}  # joined the batch late after its first token
    assert e2e.gap_stats([late, late, steady])["itg_first_p50_ms"] == 40.0
    assert e2e.gap_stats([{"gaps_ms": []}])["itg_p50_ms"] is None


# --- IndexShare (#20): the model's index pattern, sync config, the ratios ---

def test_index_pattern_reaches_sglangs_model_config(tmp_path):
    mc = _load("model_config", SCRIPTS / "model_config.py")
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_hisparse.engine.index_share import roles_from_config

    for spec, want in (("FSSS", "FSSS"), ("FSFS", "FSFS")):
        d = tmp_path / spec
        mc.write(mc.build_config("tiny", None, spec), d)
        text = ModelConfig(str(d)).hf_text_config
        assert roles_from_config(text, text.num_hidden_layers).pattern == want
    glm = mc.index_pattern("glm52", 78)
    assert len(glm) == 78 and glm.count("F") == 21 and glm[0] == "F" and "SSSS" not in glm
    assert mc.index_pattern("glm52", 4) == "FSSS"
    for bad in ("FSS", "SFFF", "FSXS", ""):
        try:
            mc.index_pattern(bad, 4)
        except ValueError as exc:
            assert "--index-pattern" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    assert mc.main(["--geometry", "tiny", "--index-pattern", "SFFF", "--out", str(tmp_path / "x")]) == 2


def test_sync_config_turns_the_prefetch_off_and_the_ratios(capsys):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    _, env = e2e.server_cmd("/m", 1, "sync", [], check=True)
    assert env["SGLANG_HISPARSE_INDEXSHARE_PREFETCH"] == "0" and env[e2e.CHECK_ENV] == "1"
    _, env = e2e.server_cmd("/m", 1, "ours", [])
    assert "SGLANG_HISPARSE_INDEXSHARE_PREFETCH" not in env
    assert e2e.CHECK_EXPECT["sync"] == "exact"
    summary = [
        {"workload": "capacity", "config": "ours", "output_tok_s": 90.0, "tpot_ms": 11.0},
        {"workload": "capacity", "config": "sync", "output_tok_s": 75.0, "tpot_ms": 13.0},
        {"workload": "capacity", "config": "noio", "output_tok_s": 100.0, "tpot_ms": 10.0},
        {"workload": "lone", "config": "ours", "output_tok_s": 1.0, "tpot_ms": 1.0},
    ]
    (row,) = e2e.summarize_indexshare(summary)
    assert row["workload"] == "capacity" and row["tok_s_vs_noio"] == 0.9
    assert abs(row["tpot_gap_closed"] - 2 / 3) < 1e-9
    assert row["tok_s_vs_noio_target_met"] and row["tpot_gap_closed_target_met"]
    out = capsys.readouterr().out
    assert "indexshare capacity" in out and "NOT met" not in out
    slow = e2e.indexshare_ratios({"output_tok_s": 80.0, "tpot_ms": 12.9},
                                 {"output_tok_s": 75.0, "tpot_ms": 13.0},
                                 {"output_tok_s": 100.0, "tpot_ms": 10.0})
    assert not slow["tok_s_vs_noio_target_met"] and not slow["tpot_gap_closed_target_met"]
    # The decode phase alone: decode-only rates and the server's decode step.
    for row, step in zip(summary, (5.0, 8.0, 4.0)):
        row["decode_step_ms"] = step
    decode = [{"workload": "capacity", "config": c, "decode_only_tok_s": r}
              for c, r in (("ours", 800.0), ("sync", 500.0), ("noio", 1000.0))]
    (row,) = e2e.summarize_indexshare(summary, decode)
    assert row["decode_only_vs_noio"] == 0.8 and row["sync_decode_only_vs_noio"] == 0.5
    assert row["step_gap_closed"] == 0.75 and row["step_gap_closed_target_met"]
    assert not row["decode_only_vs_noio_target_met"]
    out = capsys.readouterr().out
    assert "indexshare-decode capacity    0.80 (NOT met)   0.50   5.00 / 8.00 / 4.00   0.75 (met)" in out
    # warp: the prefetch with one-warp replay blocks gets its own rows.
    _, env = e2e.server_cmd("/m", 1, "warp", [])
    assert env["SGLANG_HISPARSE_PREFETCH_GRID"] == "smx32" and e2e.CHECK_EXPECT["warp"] == "exact"
    summary.append({"workload": "capacity", "config": "warp", "output_tok_s": 95.0, "tpot_ms": 10.5,
                    "decode_step_ms": 4.5})
    decode.append({"workload": "capacity", "config": "warp", "decode_only_tok_s": 900.0})
    ours, warp = e2e.summarize_indexshare(summary, decode)
    assert (ours["config"], warp["config"]) == ("ours", "warp")
    assert warp["decode_only_vs_noio"] == 0.9 and warp["step_gap_closed"] == 0.875
    out = capsys.readouterr().out
    assert "indexshare-decode capacity/warp 0.90 (met)   0.50   4.50 / 8.00 / 4.00   0.88 (met)" in out
    # prio16: the prefetch stream above the forward's priority, 16 blocks.
    _, env = e2e.server_cmd("/m", 1, "prio16", [])
    assert (env["SGLANG_HISPARSE_PREFETCH_GRID"], env["SGLANG_HISPARSE_PREFETCH_PRIORITY"]) == ("16x512", "1")
    assert e2e.CHECK_EXPECT["prio16"] == "exact"
    summary.append({"workload": "capacity", "config": "prio16", "output_tok_s": 98.0, "tpot_ms": 10.2,
                    "decode_step_ms": 4.2})
    decode.append({"workload": "capacity", "config": "prio16", "decode_only_tok_s": 950.0})
    rows = e2e.summarize_indexshare(summary, decode)
    assert [r["config"] for r in rows] == ["ours", "warp", "prio16"]
    assert rows[2]["step_gap_closed"] == 0.95
    # prio0: the default until 2026-12-05 (the forward's priority, one block per SM).
    _, env = e2e.server_cmd("/m", 1, "prio0", [])
    assert (env["SGLANG_HISPARSE_PREFETCH_GRID"], env["SGLANG_HISPARSE_PREFETCH_PRIORITY"]) == ("smx512", "0")
    assert e2e.CHECK_EXPECT["prio0"] == "exact" and "prio0" in e2e.SYNTHETIC_CONFIGS
    summary.append({"workload": "capacity", "config": "prio0", "output_tok_s": 96.0, "tpot_ms": 10.6,
                    "decode_step_ms": 6.0})
    decode.append({"workload": "capacity", "config": "prio0", "decode_only_tok_s": 800.0})
    rows = e2e.summarize_indexshare(summary, decode)
    assert [r["config"] for r in rows] == ["ours", "warp", "prio16", "prio0"]
    assert rows[3]["step_gap_closed"] == 0.5
    assert "indexshare-decode capacity/prio16" in capsys.readouterr().out


def test_log_stats_reads_the_prefetch_state(tmp_path):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    log = tmp_path / "s.log"
    for text, want in (("HiSparse IndexShare prefetch on (...): 1 anchor", True),
                       ("HiSparse IndexShare prefetch off: SGLANG_HISPARSE_INDEXSHARE_PREFETCH=0", False),
                       ("nothing", None)):
        log.write_text(text)
        assert e2e.log_stats(log, 0)["indexshare_prefetch"] is want


def test_stream_configs_set_the_streaming_switch(monkeypatch):
    monkeypatch.delenv("SGLANG_HISPARSE_STREAMING", raising=False)
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    args, env = e2e.server_cmd("/m", 1, "stream", [])
    assert env["SGLANG_HISPARSE_STREAMING"] == "1" and "--enable-hisparse" in args
    _, env = e2e.server_cmd("/m", 1, "nostream", [])
    assert env["SGLANG_HISPARSE_STREAMING"] == "0"
    args, env = e2e.server_cmd("/m", 1, "stream512", [])
    assert env["SGLANG_HISPARSE_STREAMING"] == "512" and "--enable-hisparse" in args
    assert e2e.CHECK_EXPECT["stream512"] == "exact"
    args, env = e2e.server_cmd("/m", 1, "hold", [])
    assert env["SGLANG_HISPARSE_STREAMING"] == "hold" and "--enable-hisparse" in args
    assert e2e.CHECK_EXPECT["hold"] == "exact" and "hold" in e2e.SYNTHETIC_CONFIGS
    _, env = e2e.server_cmd("/m", 1, "ours", [])
    assert "SGLANG_HISPARSE_STREAMING" not in env  # ours: the default, off
    assert e2e.CHECK_EXPECT["stream"] == e2e.CHECK_EXPECT["nostream"] == "exact"


# --------------------------------------------------------------- MTP parts
def _spec_request(ids, verify_ct, accept):
    return {"output_ids": ids, "spec_verify_ct": verify_ct, "spec_accept_length": accept,
            "logprobs": [], "top2": [], "requests": None}


def test_spec_parity_compares_verify_counts_request_by_request(capsys):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    base = {"requests": [_spec_request([1, 2, 3, 4], 2, 2.0), _spec_request([5, 6], 2, 1.0)]}
    same = {"requests": [_spec_request([1, 2, 3, 4], 2, 2.0), _spec_request([5, 7], 1, 2.0)]}
    off = {"requests": [_spec_request([1, 2, 3, 4], 3, 1.33), _spec_request([5, 6], 2, 1.0)]}
    p = e2e.spec_parity(base, same)
    assert (p["requests"], p["identical_outputs"], p["verify_ct_equal"],
            p["identical_but_verify_ct_differs"]) == (2, 1, 1, 0)  # the diverged one is not held
    assert e2e.spec_parity(base, off)["identical_but_verify_ct_differs"] == 1
    results = {"base": {"smoke": [base]}, "ours": {"smoke": [same]}, "nores": {"smoke": [off]}}
    rows = e2e.summarize_spec(results, ["base", "ours", "nores"], ["smoke"])
    assert [r.get("parity_ok") for r in rows] == [None, True, False]
    out = capsys.readouterr().out
    assert "spec smoke       ours     accept length 2.000, verify_ct equal 1/2" in out
    assert out.rstrip().endswith("NO PARITY")
    # Without MTP the servers put no spec fields in meta_info: nothing is judged.
    plain = {"requests": [dict(_spec_request([1], None, None))]}
    assert e2e.spec_parity(plain, plain)["requests"] == 0


def test_devgrowth_is_ours_with_sglangs_admission_costing(monkeypatch):
    # The side-by-side control for adapter/prefill_adder.py: the same data
    # plane and synthetic top-k, only the admission costing differs.
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    monkeypatch.delenv("SGLANG_HISPARSE_HOST_GROWTH", raising=False)
    args, env = e2e.server_cmd("m", 1, "devgrowth", [], synthetic="calibrated", check=True)
    ours_args, ours_env = e2e.server_cmd("m", 1, "ours", [], synthetic="calibrated", check=True)
    assert env.pop("SGLANG_HISPARSE_HOST_GROWTH") == "0" and "SGLANG_HISPARSE_HOST_GROWTH" not in ours_env
    assert args == ours_args and env == ours_env
    assert env[e2e.SYNTHETIC_ENV] == "calibrated" and e2e.CHECK_EXPECT["devgrowth"] == "exact"


def test_mtp_configs_and_the_drain_workloads_server(monkeypatch):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    monkeypatch.delenv("SGLANG_HISPARSE_RESIDENCY", raising=False)
    args, env = e2e.server_cmd("m", 1, "nograph", [], spec_flags=["--speculative-algorithm", "EAGLE"],
                               check=True)
    assert "--disable-cuda-graph" in args and env[e2e.CHECK_ENV] == "1"
    assert "--speculative-algorithm" in args and "SGLANG_HISPARSE_RESIDENCY" not in env
    args, env = e2e.server_cmd("m", 1, "nores", [], extra_env=e2e.WORKLOAD_ENV["drain"])
    assert env["SGLANG_HISPARSE_RESIDENCY"] == "0" and "--disable-cuda-graph" not in args
    assert env["SGLANG_TEST_RETRACT"] == "1"
    assert e2e.CHECK_EXPECT["nograph"] == e2e.CHECK_EXPECT["nores"] == "exact"
    base_args, base_env = e2e.server_cmd("m", 1, "base", e2e.WORKLOADS["drain"][2],
                                         extra_env=e2e.WORKLOAD_ENV["drain"])
    assert base_args[base_args.index("--max-total-tokens") + 1] == "30000"
    assert "--enable-hisparse" not in base_args and base_env["SGLANG_TEST_RETRACT"] == "1"


def test_mtp_model_and_flags_shared_by_e2e_and_the_profiler(tmp_path):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    model, flags = e2e.mtp_model_and_flags(str(kit), tmp_path / "logs", "3,1,4")
    served = json.loads((Path(model) / "config.json").read_text())
    assert served == {"num_hidden_layers": 4, "num_nextn_predict_layers": 1}
    assert flags == ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    # A model that has its NextN layer already is served as it is.
    assert e2e.mtp_model_and_flags(model, tmp_path / "other", "1,1,2")[0] == model
    with pytest.raises(ValueError, match="--mtp takes STEPS,TOPK,NDT"):
        e2e.mtp_model_and_flags(str(kit), tmp_path, "3,1")
    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    with pytest.raises(SystemExit):  # argparse's error names the flag
        prof.main(["--mtp", "x", "--model", str(kit), "--out", str(tmp_path)])


# The probe's decode line: DSA ours, and DeepSeek-V4 base (its pools are
# "#full token" and "#swa token"; a leaked request's full KV or SWA window
# stays in them).
DRAIN_PROBE_LINES = {
    "dsa": "Decode batch, #running-req: 1, #gpu token: {held}, #cpu token: 640\n",
    "dsv4": "Decode batch, #running-req: 1, #full token: 768, full token usage: 0.02, "
            "#swa token: {held}, swa token usage: 0.20, cuda graph: True\n",
}


DRAIN_LOGGED_TRACEBACKS = {
    "": "",
    "benign": ("Can not initialize OpenAIServingResponses, error: Traceback (most recent call last):\n"
               "ModuleNotFoundError: No module named 'openai_harmony'\n"),
    "crash": "Traceback (most recent call last):\nRuntimeError: CUDA error\n",
}


@pytest.mark.parametrize("arch", sorted(DRAIN_PROBE_LINES))
@pytest.mark.parametrize("probe_gpu,retracted,logged,ok", [
    (640, 1, "benign", True), (4800, 1, "", False), (640, 0, "", False), (640, 1, "crash", False)])
def test_drain_reads_the_pools_from_the_probes_decode_lines(tmp_path, probe_gpu, retracted, logged, ok,
                                                            arch, capsys):
    """The drain workload against a stand-in /generate that writes the log
    lines a server would: retraction events while the drain runs (retracting
    one request each, or none: one request running, as V4 at 30000 did),
    with 0.5.13's benign start-up traceback or a crash's among them, then
    the probe's decode lines (the pools with the probe alone, or with a
    leaked hot buffer or SWA window)."""
    from test_pd_gpu_script import Endpoint, sse

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    log = tmp_path / "server.log"
    log.write_text("launch\n")
    aborted = set()
    probes: list[int] = []

    def answer(body):
        if "input_ids" not in body:  # /abort_request
            aborted.add(body["rid"])
            return
        n = body["sampling_params"]["max_new_tokens"]
        probe = len(body["input_ids"]) == e2e.PROBE_LEN
        if probe:  # before the drain the pools hold the probe alone
            probes.append(640 if not probes else probe_gpu)
        with log.open("a") as f:
            f.write(DRAIN_PROBE_LINES[arch].format(held=probes[-1])
                    if probe else f"Testing retraction. #retracted_reqs: {retracted}\n"
                    + DRAIN_LOGGED_TRACEBACKS[logged])
        for k in range(1, n + 1):
            stop = body.get("rid") in aborted
            meta = ({"finish_reason": {"type": "abort"}} if stop else
                    {"spec_verify_ct": n // 2, "spec_accept_length": 2.0} if k == n else {})
            yield sse({"output_ids": [k - 1], "meta_info": meta})  # incremental: the new token
            if stop:
                break
            time.sleep(0.02)
        yield "data: [DONE]"

    ep = Endpoint(answer)
    try:
        res = e2e.run_drain(ep.url, log, max_new=12)
    finally:
        ep.close()
    v = res["drain"]
    assert v["completed"] == v["expected"] == 4 and v["probe_ok"]
    assert v["aborted"] == e2e.DRAIN_ABORTS and aborted == {f"drain-abort-{k}" for k in range(4)}
    assert all(x["finish_reason"] == {"type": "abort"} for x in v["aborts"])
    held = "#gpu token" if arch == "dsa" else "#swa token"
    assert probes == [640, probe_gpu]  # the same probe before the drain and after it
    assert v["probe_pools_before"][held] == 640
    assert v["retraction_events"] == 8 and v["retractions"] == 8 * retracted
    assert v["probe_pools"][held] == probe_gpu
    assert v["pools_back"] is (probe_gpu == 640) and v["ok"] is ok
    assert [q["spec_verify_ct"] for q in res["requests"]] == [6] * 4
    e2e.summarize_drain({"ours": {"drain": [res]}}, ["ours"])
    assert capsys.readouterr().out.rstrip().endswith("OK" if ok else "FAILED")


def test_drain_pools_judged_against_the_probe_before_the_drain():
    """Ours on DeepSeek-V4 reads a constant #full token (its C4 budget caps
    full_available_size): the probe alone read 19456 after the 2026-12-06-s2
    H200 drain, over the absolute bound with nothing else held. The same
    readings before and after pass; a leaked hot buffer (4352 tokens) or
    host rows more after than before fail."""
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    v4 = {"#gpu token": 1120, "#cpu token": 192, "#token": None, "#full token": 19456,
          "#swa token": 768}
    assert max(v for v in v4.values() if v) > e2e.DRAIN_POOL_BOUND
    assert e2e.pools_as_before(v4, dict(v4))
    assert not e2e.pools_as_before(v4, dict(v4, **{"#full token": 19456 + 4352}))
    assert not e2e.pools_as_before(v4, dict(v4, **{"#cpu token": 192 + 2304}))
    # A pool the probe did not show before cannot be judged: not back.
    assert not e2e.pools_as_before(dict(v4, **{"#token": None}), dict(v4, **{"#token": 5}))
    # No line before the drain (a probe that failed): the absolute bound.
    nothing = dict.fromkeys(v4)
    assert e2e.pools_as_before(nothing, {"#gpu token": 704, "#cpu token": 0})
    assert not e2e.pools_as_before(nothing, v4)
    assert not e2e.pools_as_before(v4, nothing)


def test_v4_drain_gets_its_own_device_pool():
    """The drain on DeepSeek-V4 launches at --max-total-tokens 60000 (the
    later flag wins), so more than one request runs and is retracted; DSA
    keeps 30000; the other workloads are unchanged."""
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    env = tuple(sorted(e2e.WORKLOAD_ENV["drain"].items()))
    v4_drain = ("--max-total-tokens", "30000", "--max-total-tokens", "60000")
    v4 = e2e.launch_groups(["smoke", "drain"], "dsv4")
    assert v4[(v4_drain, env)] == ["drain"]
    assert v4[((), ())] == ["smoke"]
    dsa = e2e.launch_groups(["smoke", "drain"], "dsa")
    assert dsa[(("--max-total-tokens", "30000"), env)] == ["drain"]
    cmd, _ = e2e.server_cmd("tests/data/tiny-dsv4", 1, "ours", list(v4_drain))
    at = [i for i, a in enumerate(cmd) if a == "--max-total-tokens"]
    assert cmd[at[-1] + 1] == "60000"


def test_mtp_targets_from_the_summary(capsys):
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    summary = [{"workload": "lone", "config": "ours", "tpot_vs_base": 1.07, "runs": 2},
               {"workload": "capacity", "config": "ours", "tok_s_vs_base": 2.4, "runs": 2},
               {"workload": "lone", "config": "base", "tpot_vs_base": 1.0, "runs": 2}]
    rows = e2e.summarize_mtp_targets(summary)
    assert [(r["workload"], r["met"]) for r in rows] == [("lone", False), ("capacity", True)]
    out = capsys.readouterr().out
    assert "mtp target lone      ours tpot_vs_base 1.070 (target <= 1.05: NOT met; 2 run(s))" in out


def test_the_decode_bound_workloads_hold_two_base_requests():
    """decodebound and decodelong: 16 x 32K prompts whose full length fits
    the context, and a pool that holds two of them whole (base's batch) but
    not three, so that ours' hot buffers are what lets 16 decode at once.
    decodelong gets the same #16 target lines as decodebound."""
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    for name in ("decodebound", "decodelong"):
        groups, out_tokens, flags = e2e.WORKLOADS[name]
        (prompts,) = groups
        pool = int(flags[flags.index("--max-total-tokens") + 1])
        context = int(flags[flags.index("--context-length") + 1])
        whole = max(prompts) + out_tokens
        assert len(prompts) == 16 and whole <= context
        assert 2 * whole <= pool < 3 * max(prompts), name
    targets = {k[1:] for k in e2e.REALISTIC_TARGETS if k[0] == "decodebound"}
    assert targets == {k[1:] for k in e2e.REALISTIC_TARGETS if k[0] == "decodelong"}
    assert ("ours", "summary", "tok_s_vs_base") in targets


@pytest.mark.parametrize("synthetic, noio_met", [("calibrated", False), (None, True)])
def test_realistic_targets_from_the_summary_and_decode_tables(capsys, synthetic, noio_met):
    """Issue #16's lines: each ratio judged against its target, ours / noio
    against 0.9 with the calibrated top-k and 0.8 with the random weights',
    the streaming gaps for every decode row, and nothing for a ratio the run
    lacks (no native here: no vs-native line)."""
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    summary = [{"workload": "decodebound", "config": "ours", "tok_s_vs_base": 3.4, "output_tok_s": 850.0,
                "runs": 3},
               {"workload": "decodebound", "config": "noio", "output_tok_s": 1000.0, "runs": 3},
               {"workload": "lone32k", "config": "ours", "tpot_vs_base": 1.02, "runs": 3},
               {"workload": "lone32k", "config": "nores", "tpot_vs_base": 1.2, "runs": 3}]
    decode = [{"workload": "decodebound", "config": "ours", "decode_only_vs_base": 4.5,
               "itg_worst_over_median": 12.0, "itg_p99_over_tpot": 2.0},
              {"workload": "decodebound", "config": "noio", "itg_worst_over_median": None}]
    rows = e2e.summarize_realistic_targets(summary, decode, synthetic)
    got = {(r["workload"], r["config"], r["ratio"]): r["met"] for r in rows}
    assert got == {("decodebound", "ours", "tok_s_vs_base"): True,
                   ("decodebound", "ours", "tok_s_vs_noio"): noio_met,
                   ("decodebound", "ours", "decode_only_vs_base"): True,
                   ("lone32k", "ours", "tpot_vs_base"): True,
                   ("lone32k", "nores", "tpot_vs_base"): False,
                   ("decodebound", "ours", "itg_worst_over_median"): False,
                   ("decodebound", "ours", "itg_p99_over_tpot"): True}
    out = capsys.readouterr().out
    threshold = "0.9" if synthetic else "0.8"
    assert (f"#16 target decodebound ours      tok_s_vs_noio 0.850 (target >= {threshold}: "
            f"{'met' if noio_met else 'NOT met'}; 3 run(s))") in out
    assert "#16 target lone32k     nores     tpot_vs_base 1.200 (target <= 1.15: NOT met; 3 run(s))" in out


def test_bundle_imports_names_the_package_a_device_would_lack(tmp_path):
    """scripts/bundle_imports.py against this venv: with every distribution
    on the 'device' SGLang's HTTP server imports; without fastapi it fails
    and names it (0.5.17's xgrammar was found this way before a device run)."""
    import importlib.metadata as md

    tool = _load("bundle_imports", SCRIPTS / "bundle_imports.py")
    every = sorted({tool.norm(d.metadata["Name"]) for d in md.distributions()})
    args = ["--python", sys.executable, "--modules", "sglang.srt.entrypoints.http_server"]
    for dists, rc in ((every, 0), ([d for d in every if d != "fastapi"], 1)):
        listing = tmp_path / f"device-{rc}.txt"
        listing.write_text("".join(f"{d}==0\n" for d in dists))
        assert tool.main([*args, "--device-packages", str(listing)]) == rc


def test_jitfit_saves_the_cache_only_with_a_minute_left():
    """gpu_stages.sh's jitfit_left: ``jitfit`` keeps nothing back from the
    stages (``jit`` keeps 60 s), and saves the JIT cache only when 60 s
    are left after them and the 15 s of log packing."""
    import subprocess

    import re

    elapsed_fn = re.search(r"^elapsed\(\) .*$", (SCRIPTS / "gpu_stages.sh").read_text(), re.M).group(0)

    def left(elapsed):
        script = (stage_functions("jitfit_left") + elapsed_fn
                  + f"\nT0=$(( $(date +%s) - {elapsed} )); BUDGET_S=590; jitfit_left")
        return int(subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout)

    assert 66 <= left(508) <= 67   # 2026-12-06-s5's cold decodelong call ended at 508 s
    assert left(530) < 60
    text = (SCRIPTS / "gpu_stages.sh").read_text()
    assert 'if [ "$jit_left" -ge 60 ]; then WANT_JIT=1' in text


def test_install_tree_gives_sglang_the_plugins_entry_point(tmp_path):
    """scripts/install_tree.py (gpu_stages' install, no build): the copied
    package carries its kernel sources and patches, and its dist-info
    answers importlib.metadata as pip's would: the name, the version and
    setup.cfg's entry points, the plugin's among them (SGLang's loader
    finds plugins there). It runs isolated (``-I -S``), where this
    package is not importable, as on the device."""
    import importlib.metadata as md
    import subprocess

    import sglang_hisparse

    done = subprocess.run([sys.executable, "-I", "-S", str(SCRIPTS / "install_tree.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    info = Path(done.stdout.strip())
    (dist,) = md.distributions(path=[str(tmp_path)])
    assert dist.locate_file(info.name) == info
    assert dist.metadata["Name"] == "sglang-hisparse"
    assert dist.version == sglang_hisparse.__version__
    points = {(e.group, e.name): e.value for e in dist.entry_points}
    assert points[("sglang.srt.plugins", "sglang_hisparse")] == "sglang_hisparse.plugin:register"
    assert points[("console_scripts", "sglang-hisparse")] == "sglang_hisparse.__main__:main"
    package = tmp_path / "sglang_hisparse"
    assert list(package.glob("jit_csrc/*.cuh")) and list(package.glob("patches/*/pin.json"))
    assert not list(package.rglob("__pycache__"))


@pytest.mark.parametrize("before", ["/tmp/site", "/tmp/site-0.5.17"])
def test_use_site_points_both_paths_at_one_pin(before):
    """gpu_stages.sh's use_site: a command on another pin (GF_SGLANG) and each
    pin of the pin stage (GF_PIN_SGLANG) swap the site on the Python path and
    the library path, whichever pin's site was there, and nothing else."""
    import subprocess

    function = stage_functions("use_site")
    # The site first (device_env.sh's order) or after our package (the pin stage's).
    for site, ahead in [(s, a) for s in ("/tmp/site-0.5.17", "/tmp/site") for a in ("", "/tmp/proj:")]:
        env = {"PATH": os.environ["PATH"],
               "PYTHONPATH": f"{ahead}{before}:/kit/testweights",
               "LD_LIBRARY_PATH": f"{before}/_libs:/usr/lib"}
        out = subprocess.run(["bash", "-c", function + f'use_site {site}; echo "$PYTHONPATH|$LD_LIBRARY_PATH"'],
                             capture_output=True, text=True, env=env, check=True).stdout.strip()
        assert out == f"{ahead}{site}:/kit/testweights|{site}/_libs:/usr/lib"


def test_sglang_where_names_the_pin_the_python_path_imports_without_importing_it(tmp_path):
    """gpu_stages.sh's sglang_where: the version and folder of the sglang
    first on the Python path (the one the servers import), read from the
    dist-info beside that folder, so a pin's site put first (use_site) is
    the one named, and a site without a dist-info says so."""
    import subprocess

    import sglang

    function = stage_functions("sglang_where")

    def where(pythonpath: str) -> str:
        # This interpreter's folder first: its python3 sees the installed pin.
        env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": pythonpath}
        return subprocess.run(["bash", "-c", function + "sglang_where"], capture_output=True,
                              text=True, env=env, check=True).stdout.strip()

    assert where("") == f"{sglang.__version__} from {Path(sglang.__path__[0])}"
    site = tmp_path / "site-9.9.9"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("raise SystemExit('imported')\n")
    assert where(str(site)) == f"(no dist-info) from {site / 'sglang'}"
    info = site / "sglang-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.9\n")
    assert where(str(site)) == f"9.9.9 from {site / 'sglang'}"


def test_kbench_runs_the_tables_gf_kbench_names(tmp_path):
    """gpu_stages.sh's kbench_cmd: decode and verify by default, only the
    named tables with GF_KBENCH (overlap: the prefetch replay beside
    compute), and an unknown name is refused naming the ones it knows."""
    import subprocess

    function = stage_functions("kbench_cmd")
    echoing_python3(tmp_path)  # instead of timing anything

    def run(kbench, **extra):
        env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "RUN": "/r",
               **({"GF_KBENCH": kbench} if kbench is not None else {}), **extra}
        p = subprocess.run(["bash", "-c", function + "kbench_cmd"], capture_output=True, text=True, env=env)
        return p.returncode, p.stdout.strip().splitlines()

    assert run(None) == (0, ["scripts/bench_kernels.py --quick --json /r/kbench_decode.json",
                             "scripts/bench_kernels.py --verify 2,4 --json /r/kbench_verify.json"])
    assert run("overlap") == (0, ["scripts/bench_kernels.py --overlap --json /r/kbench_overlap.json"])
    assert run("overlap", GF_OVERLAP_GRIDS="8x512,1024x512") == (
        0, ["scripts/bench_kernels.py --overlap 8x512,1024x512 --json /r/kbench_overlap.json"])
    assert run("overlap bogus") == (2, ["scripts/bench_kernels.py --overlap --json /r/kbench_overlap.json",
                                        "GF_KBENCH: unknown table bogus (decode verify overlap)"])


def test_indexshare_waits_for_the_time_its_launches_need():
    """gpu_stages.sh's indexshare_need_s: the stage starts only with ~100 s
    per launch on the V3.2 geometry (~60 s on the kit model), times rounds;
    2026-12-03-s5's run 3 started three V3.2 launches with 215 s and timed
    out after the first."""
    import subprocess

    function = stage_functions("indexshare_need_s")
    assert 'run_stage indexshare "$(indexshare_need_s)"' in (SCRIPTS / "gpu_stages.sh").read_text()

    def need(**env):
        out = subprocess.run(["bash", "-c", function + "indexshare_need_s"], capture_output=True,
                             text=True, env={"PATH": os.environ["PATH"], **env}, check=True)
        return int(out.stdout)

    assert need() == 30 + 60 * 4
    assert need(GF_INDEXSHARE_LAYERS="8", GF_INDEXSHARE_CONFIGS="ours,sync,noio") == 330
    assert need(GF_INDEXSHARE_LAYERS="8", GF_INDEXSHARE_CONFIGS="ours,warp,sync,noio",
                GF_INDEXSHARE_REPEATS="2") == 30 + 100 * 8
    # at once: about two launches, whatever the configs and patterns
    assert need(GF_PARALLEL="1") == 30 + 60 * 2
    assert need(GF_PARALLEL="1", GF_INDEX_PATTERN="FSSS,glm52@12") == 30 + 100 * 2
    assert need(GF_PARALLEL="1", GF_INDEXSHARE_CHECK="0", GF_INDEXSHARE_LAYERS="8") == 30 + 100 * 4
    # together: one start-up, then half a launch per config and round
    assert need(GF_INDEXSHARE_TOGETHER="1", GF_INDEXSHARE_CHECK="0", GF_INDEXSHARE_LAYERS="20",
                GF_INDEXSHARE_CONFIGS="ours,sync,noio", GF_INDEXSHARE_INNER="3") == 30 + 100 + 50 * 9
    assert need(GF_INDEXSHARE_TOGETHER="1", GF_INDEXSHARE_CONFIGS="ours,sync,noio") == 30 + 60 * 3


def test_wait_calls_reports_each_call_and_fails_if_one_failed(tmp_path):
    """gpu_stages.sh's wait_calls (the mtpproof and indexshare stages' several
    e2e calls): each call's status, launch lines and tables under its title,
    a title holding | (mtpproof's call specs) kept whole, rc 1 if any failed."""
    import subprocess

    out = tmp_path / "a.out"
    out.write_text("[ours rep0] sglang_hisparse from x\n[ours rep0] ready in 9s\nnoise\n"
                   "workload    config  runs\ncapacity    ours  1\n")
    script = stage_functions("wait_calls") + (
        f'(exit 3) & p=$!; wait_calls "done:0|{out}|mtpproof a112|X=1|1,1,2" "$p|{out}|second"')
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stdout.splitlines() == [
        "== mtpproof a112|X=1|1,1,2: rc 0", "[ours rep0] ready in 9s", "workload    config  runs",
        "capacity    ours  1", "== second: rc 3", "[ours rep0] ready in 9s", "workload    config  runs",
        "capacity    ours  1"]


def test_indexshare_runs_each_pattern_on_ports_of_its_own(tmp_path):
    """gpu_stages.sh's indexshare_cmd: several GF_INDEX_PATTERN entries are
    one e2e_gpu.py call each, 100 ports apart, with outputs of their own;
    PATTERN@N serves the V3.2 geometry with N layers (launched at once, at
    --parallel's memory fraction); one pattern keeps the old output names
    and, timed one launch after the other, the 0.45 fraction."""
    import subprocess

    functions = stage_functions("wait_calls", "indexshare_one", "indexshare_cmd")
    echoing_python3(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def run(parallel, **env):
        prelude = (f"E2E=(python3 scripts/e2e_gpu.py --port 30010); PORT=30010; RUN={run_dir}; "
                   f"CPU_ARGS=(--cpu-probe); PAR=({'--parallel' if parallel else ''}); ")
        p = subprocess.run(["bash", "-c", functions + prelude + "indexshare_cmd"], capture_output=True,
                           text=True, env={"PATH": f"{tmp_path}:{os.environ['PATH']}", **env})
        return p.returncode, p.stdout

    rc, out = run(True, GF_PARALLEL="1", GF_INDEX_PATTERN="FSSS,glm52@12")
    assert rc == 0 and "== indexshare FSSS: rc 0" in out and "== indexshare glm52@12: rc 0" in out
    kit = (run_dir / "indexshare_FSSS.out").read_text()
    deep = (run_dir / "indexshare_glm52_12.out").read_text()
    assert "--port 30010 --configs base,ours,sync,noio" in kit and "--index-pattern FSSS" in kit
    assert "--geometry" not in kit and f"--out {run_dir}/indexshare_FSSS.json" in kit
    assert "--port 30110 " in deep and "--index-pattern glm52" in deep and "--check --warmup 0 --parallel" in deep
    assert "--geometry v32 --layers 12 --server-args --cuda-graph-max-bs 16" in deep
    assert f"--out {run_dir}/indexshare_glm52_12.json" in deep

    # one after the other (no --parallel): the same calls, each waited for in turn
    rc, out = run(False, GF_INDEX_PATTERN="FSSS,FSFS")
    assert rc == 0 and "== indexshare FSSS: rc 0" in out and "== indexshare FSFS: rc 0" in out
    assert "--port 30110 " in (run_dir / "indexshare_FSFS.out").read_text()

    rc, out = run(False, GF_INDEXSHARE_CHECK="0", GF_INDEXSHARE_LAYERS="8", GF_INDEX_PATTERN="glm52")
    assert rc == 0
    assert "--server-args --mem-fraction-static 0.45 --cuda-graph-max-bs 16" in out
    assert f"--out {run_dir}/indexshare.json" in out and "--check" not in out
    assert "--inner-repeats 1 " in out and "--together" not in out
    rc, out = run(False, GF_INDEXSHARE_CHECK="0", GF_INDEXSHARE_LAYERS="20", GF_INDEX_PATTERN="glm52",
                  GF_INDEXSHARE_TOGETHER="1", GF_INDEXSHARE_INNER="3")
    assert rc == 0 and "--inner-repeats 3 --together " in out
    rc, out = run(False, GF_INDEXSHARE_TOGETHER="1")  # with the check: launches as before
    assert rc == 0 and "--together" not in out


def test_a_server_whose_log_stops_is_reported_stalled_not_waited_for(tmp_path):
    """run_workload against a stand-in /generate: one that holds its request
    (a prompt the scheduler never prefills) while the log stands still is
    reported within seconds; one that answers slowly while its log grows
    (a server at work) is waited for."""
    from test_pd_gpu_script import Endpoint, sse

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    log = tmp_path / "server.log"
    log.write_text("launch\n")
    release = threading.Event()

    def held(body):
        release.wait(60)
        yield "data: [DONE]"

    ep = Endpoint(held)
    t0 = time.time()
    try:
        with pytest.raises(e2e.ServerStalled, match="1 of 1 requests outstanding"):
            e2e.run_workload(ep.url, "concurrent", max_requests=1, max_new=4, log_path=log,
                             stall_s=1.0)
        assert time.time() - t0 < 20
    finally:
        release.set()
        ep.close()

    def slow(body):  # 6.4 s, past the watchdog's first look at 5 s
        for k in range(1, 5):
            time.sleep(1.6)
            with log.open("a") as f:
                f.write("Decode batch, #running-req: 1\n")
            yield sse({"output_ids": [k - 1], "meta_info": {}})
        yield "data: [DONE]"

    ep = Endpoint(slow)
    try:
        res = e2e.run_workload(ep.url, "concurrent", max_requests=1, max_new=4, log_path=log,
                               stall_s=2.0)
    finally:
        ep.close()
    assert not res["errors"] and len(res["requests"]) == 1


def test_a_workloads_requests_come_back_in_the_order_sent():
    # The comparisons with base pair requests by position: a group's results
    # keep the order of its prompts, whichever finishes first.
    from test_pd_gpu_script import Endpoint, sse

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")

    def answer(body):  # the longer the prompt, the sooner it finishes
        time.sleep(max(0.0, 2.0 - len(body["input_ids"]) / 5000))
        yield sse({"output_ids": [len(body["input_ids"])], "meta_info": {}})
        yield "data: [DONE]"

    ep = Endpoint(answer)
    try:
        res = e2e.run_workload(ep.url, "smoke", max_new=1)
    finally:
        ep.close()
    assert [r["output_ids"][0] for r in res["requests"]] == [600, 3000, 9000, 7000, 8500]


def test_long_collections_in_the_tokenizer_manager_are_counted_per_run(tmp_path, caplog):
    # Every server logs its tokenizer manager's collections over 0.1 s: its
    # streams stand still meanwhile while the scheduler decodes on, so a gap
    # the decode log does not show can be told from one it does. The line
    # comes from SGLang's own callback, so the pattern reads its words.
    import gc
    import logging
    import re

    from sglang.srt.utils import common

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    cmd, _ = e2e.server_cmd("/m", 1, "base", [])
    assert cmd[cmd.index("--gc-warning-threshold-secs") + 1] == "0.1"
    before = list(gc.callbacks)
    try:
        common.configure_gc_warning(0.0)  # every collection is "long"
        with caplog.at_level(logging.WARNING, logger=common.logger.name):
            gc.collect()
    finally:
        gc.callbacks[:] = before
    said = [r.getMessage() for r in caplog.records if "GARBAGE COLLECTION" in r.getMessage()]
    assert said
    log = tmp_path / "server.log"
    log.write_text(_decode_line(16, 0) + "".join(f"[2026-12-07 19:50:09] {m}\n" for m in said[:1])
                   + _decode_line(16, 0))
    mark = log.stat().st_size
    with log.open("a") as f:
        f.write(f"[2026-12-07 19:50:10] {re.sub(r'Duration: [0-9.]+s', 'Duration: 0.7350s', said[0])}\n")
    whole, after = e2e.log_stats(log, 0), e2e.log_stats(log, mark)
    assert whole["long_gc"] == 2 and after["long_gc"] == 1
    assert after["long_gc_max_s"] == 0.735
    assert e2e.log_stats(log, log.stat().st_size)["long_gc_max_s"] is None


def test_freeze_gc_posts_to_the_route_sglang_serves_after_the_warm_up():
    # --freeze-gc follows SGLang's advice against its collections' jitter
    # (-s11: the one hold run over the gap target had a 0.724 s collection).
    # The path is one that 0.5.13's HTTP server routes for POST; with the
    # flag it is sent and the launch record says so, without it nothing is
    # (when, in both launch paths: test_prefill_warmup_sends_...).
    from sglang.srt.entrypoints import http_server

    from test_pd_gpu_script import Endpoint, sse

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    routes = {r.path: r.methods for r in http_server.app.routes if hasattr(r, "methods")}
    assert "POST" in routes[e2e.FREEZE_GC_PATH]
    ep = Endpoint(lambda body: [sse({"ok": True}), "data: [DONE]"])
    try:
        for flag, sent in ((True, [e2e.FREEZE_GC_PATH]), (False, [])):
            args = e2e.build_parser().parse_args(["--freeze-gc"] if flag else [])
            record = {}
            e2e.after_warm_up(ep.url, "hold", 0, args, record)
            assert ep.paths == sent and record.get("gc_frozen", False) is flag
            ep.paths.clear()
    finally:
        ep.close()


def test_a_stream_of_incremental_events_adds_up():
    """Every server streams with --incremental-streaming-output: each event
    holds its new tokens and their logprobs (several under MTP), the scalars
    are the request's so far. stream_generate returns the whole output; the
    drain's abort_after counts the tokens, not the events."""
    from test_pd_gpu_script import Endpoint, sse

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    cmd, _ = e2e.server_cmd("/m", 1, "ours", [])
    assert "--incremental-streaming-output" in cmd
    chunks = [[5], [6, 7], [8]]  # the second: a verify step that accepted two

    def answer(body):
        for k, ids in enumerate(chunks):
            last = k == len(chunks) - 1
            yield sse({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [[-0.5 * t, t, None] for t in ids],
                "output_top_logprobs": [[[-0.5 * t, t, None], [-9.0, 1, None]] for t in ids],
                "spec_verify_ct": k + 1, "finish_reason": {"type": "length"} if last else None}})
        yield "data: [DONE]"

    ep = Endpoint(answer)
    try:
        out = e2e.stream_generate(ep.url, [1, 2, 3], 4)
        aborted = e2e.abort_after(ep.url, [1, 2, 3], 4, 99, "rid")
    finally:
        ep.close()
    assert out["output_ids"] == [5, 6, 7, 8]
    assert out["logprobs"] == [-2.5, -3.0, -3.5, -4.0]
    assert out["top2"] == [[-2.5, -9.0], [-3.0, -9.0], [-3.5, -9.0], [-4.0, -9.0]]
    assert (out["spec_verify_ct"], out["finish_reason"]) == (3, {"type": "length"})
    assert len(out["gaps_ms"]) == 2  # between events
    assert (aborted["streamed"], aborted["output_tokens"]) == (3, 4)


def test_the_client_collects_no_garbage_while_a_workload_streams(monkeypatch):
    """The benchmark client's own collections landed in the inter-token gaps
    it measures (2026-12-06-s4): while a workload's requests stream, the
    collector is off; afterwards it is as it was."""
    import gc

    from test_pd_gpu_script import Endpoint, sse

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    seen = []
    real = e2e.read_stream

    def stream(*a, **kw):
        seen.append(gc.isenabled())
        return real(*a, **kw)

    monkeypatch.setattr(e2e, "read_stream", stream)
    ep = Endpoint(lambda body: iter([sse({"output_ids": [1], "meta_info": {}}), "data: [DONE]"]))
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            seen.clear()
            e2e.run_workload(ep.url, "smoke", max_new=1)
            assert seen == [False] * 5 and gc.isenabled() == before
    finally:
        gc.enable()
        ep.close()


def test_a_workload_parses_its_streams_only_after_all_have_ended(monkeypatch):
    """A workload's requests stream on threads of one process. A thread that
    parsed its events and built its result as its stream ended held the
    interpreter while the others were still receiving, and the benchmark
    measured the last tokens late (2026-12-07-s6: 12-19x the median gap
    against 4-8x on a stand-in server ending 8 of 16 streams a tick early).
    The streams here end 6-90 ms after their first event; none is parsed
    while one is open, and the results are what stream_generate returns."""
    from test_pd_gpu_script import Endpoint, sse

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    real_read, real_parse = e2e.read_stream, e2e.parse_stream
    lock, open_streams, open_at_parse = threading.Lock(), [0], []

    def read(*a, **kw):
        with lock:
            open_streams[0] += 1
        try:
            return real_read(*a, **kw)
        finally:
            with lock:
                open_streams[0] -= 1

    def parse(raw):
        open_at_parse.append(open_streams[0])
        return real_parse(raw)

    def answer(body):
        n = len(body["input_ids"])
        yield sse({"output_ids": [n], "meta_info": {"output_token_logprobs": [[-1.0, n, None]]}})
        time.sleep(n / 100000)  # smoke's prompts: 600-9000 tokens
        yield sse({"output_ids": [7], "meta_info": {"output_token_logprobs": [[-2.0, 7, None]],
                                                    "finish_reason": {"type": "length"}}})
        yield "data: [DONE]"

    ep = Endpoint(answer)
    try:
        monkeypatch.setattr(e2e, "read_stream", read)
        monkeypatch.setattr(e2e, "parse_stream", parse)
        res = e2e.run_workload(ep.url, "smoke", max_new=2)
        one = e2e.stream_generate(ep.url, [1, 2, 3], 2)
    finally:
        ep.close()
    assert open_at_parse[:5] == [0] * 5 and not res["errors"]
    assert [r["output_ids"] for r in res["requests"]] == [[600, 7], [3000, 7], [9000, 7], [7000, 7], [8500, 7]]
    assert res["requests"][0]["logprobs"] == [-1.0, -2.0] and len(res["requests"][0]["gaps_ms"]) == 1
    assert one["output_ids"] == [3, 7] and one["finish_reason"] == {"type": "length"}


class _StandInServer:
    """e2e_gpu.Server's shape over an HTTP stand-in: records the command the
    real one would run, when it started and stopped; its /generate answers
    every prompt with the same ids (the long prompt's last token differs in
    the configuration ``differs``), top-2 logprobs and speculative counts."""

    events: list = []
    requests: list = []  # (config, prompt length, max_new_tokens), as they come
    differs = None

    def __init__(self, model, port, config, extra, log_path, step_timer_out=None, cpus=None,
                 step_profile=False, **opts):
        from test_pd_gpu_script import Endpoint, sse

        e2e = sys.modules["e2e_gpu"]
        self.cmd, _ = e2e.server_cmd(model, port, config, extra, **opts)
        self.config, self.port = config, port
        log_path.write_text("launch\n")
        differs = config == _StandInServer.differs

        def answer(body):
            if "sampling_params" not in body:  # --freeze-gc's POST /freeze_gc
                _StandInServer.requests.append((config, "freeze_gc", None))
                yield sse({})
                return
            n = body["sampling_params"]["max_new_tokens"]
            _StandInServer.requests.append((config, len(body["input_ids"]), n))
            ids = [7] * n
            if differs and len(body["input_ids"]) > 2048:
                ids[-1] = 8
            time.sleep(0.05)
            yield sse({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [[-0.1, t] for t in ids],
                "output_top_logprobs": [[[-0.1, t], [-3.0, 1]] for t in ids],
                "spec_verify_ct": n, "spec_accept_length": 1.0}})
            yield "data: [DONE]"

        self.endpoint = Endpoint(answer)
        self.url = self.endpoint.url
        _StandInServer.events.append(("start", config, time.time()))

    def wait_ready(self, timeout=420):
        time.sleep(0.3)
        return 0.3

    def terminate(self):
        _StandInServer.events.append(("terminate", self.config, time.time()))

    def stop(self):
        _StandInServer.events.append(("stop", self.config, time.time()))
        self.endpoint.close()


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_launches_every_config_at_once_and_plain_runs_without_mtp(
        tmp_path, monkeypatch, capsys, parallel):
    """--parallel starts every configuration before any stops, each on its
    own port with the parallel memory fraction; without it each launch
    starts after the one before stopped. plain drops the EAGLE flags and
    HiSparse, and every configuration is compared with it: identical
    requests, short ones (within index_topk) counted apart."""
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    monkeypatch.setitem(sys.modules, "e2e_gpu", e2e)
    monkeypatch.setattr(e2e, "Server", _StandInServer)
    monkeypatch.setattr(e2e, "package_origin", lambda env: {"origin": "stand-in"})
    _StandInServer.events, _StandInServer.differs = [], "ours"
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    launched = []
    real_init = _StandInServer.__init__

    def record(self, *a, **kw):
        real_init(self, *a, **kw)
        launched.append(self)

    monkeypatch.setattr(_StandInServer, "__init__", record)
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", [
        "e2e_gpu.py", "--model", str(kit), "--configs", "base,ours,plain", "--workloads", "smoke",
        "--mtp", "1,1,2", "--warmup", "0", "--port", "31000", "--out", str(out),
        "--logs", str(tmp_path / "logs")] + (["--parallel"] if parallel else []))
    assert e2e.main() == 0

    starts = {c: t for kind, c, t in _StandInServer.events if kind == "start"}
    stops = {c: t for kind, c, t in _StandInServer.events if kind == "stop"}
    if parallel:
        assert max(starts.values()) < min(stops.values())
        assert {s.config: s.port for s in launched} == {"base": 31000, "ours": 31007, "plain": 31014}
        # torch.distributed's store port too: SGLang's own pick raced (EADDRINUSE).
        assert all(s.cmd[s.cmd.index("--nccl-port") + 1] == str(s.port + 1) for s in launched)
    else:
        assert starts["ours"] >= stops["base"] and starts["plain"] >= stops["ours"]
        assert {s.port for s in launched} == {31000}
    cmds = {s.config: s.cmd for s in launched}
    fraction = [c[c.index("--mem-fraction-static", i) + 1] for c in cmds.values()
                for i in [len(c) - 1 - c[::-1].index("--mem-fraction-static")]]
    assert fraction == ([e2e.PARALLEL_MEM_FRACTION] * 3 if parallel else ["0.35"] * 3)
    assert "--speculative-algorithm" in cmds["base"] and "--speculative-algorithm" in cmds["ours"]
    assert "--speculative-algorithm" not in cmds["plain"]
    assert "--enable-hisparse" in cmds["ours"] and "--enable-hisparse" not in cmds["plain"]

    summary = {r["config"]: r for r in json.loads(out.read_text())["summary"]}
    # ours differs from both on the long prompts' last token only.
    for key in ("exactness", "exactness_vs_plain"):
        ex = summary["ours"][key]
        assert (ex["requests"], ex["identical"], ex["short_requests"], ex["short_identical"]) == \
            (5, 1, 1, 1)
        assert ex["violations"] == 4  # a confident step that differs
    assert summary["base"]["exactness_vs_plain"]["identical"] == 5
    assert "exactness_vs_plain" not in summary["plain"]
    assert "vs plain: 116 steps, 4 over 0.05, max 0.0; identical 1/5 (short 1/1)" in capsys.readouterr().out


def test_together_starts_every_server_then_runs_one_at_a_time(tmp_path, monkeypatch):
    """--together: every server starts before the first run and stops after
    the last; runs go one server at a time, the configurations taking turns
    and the order reversed every other round; with --cpus the server whose
    turn it is gets those cores and the idle ones the rest."""
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    monkeypatch.setitem(sys.modules, "e2e_gpu", e2e)
    monkeypatch.setattr(e2e, "Server", _StandInServer)
    monkeypatch.setattr(e2e, "package_origin", lambda env: {"origin": "stand-in"})
    _StandInServer.events, _StandInServer.differs = [], None
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    runs, moves = [], []
    real_run = e2e.measured_run

    saved = []  # runs in the partial JSON as each run begins

    def run(srv, cfg, *a, **kw):
        _StandInServer.events.append(("run", cfg, time.time()))
        out = tmp_path / "e2e.json"
        saved.append(sum(len(by_w["smoke"]) for by_w in json.loads(out.read_text())["runs"].values())
                     if out.exists() else 0)
        runs.append(cfg)
        return real_run(srv, cfg, *a, **kw)

    monkeypatch.setattr(e2e, "measured_run", run)
    monkeypatch.setattr(e2e, "move_server", lambda srv, cpus: moves.append((srv.config, set(cpus))))
    core = min(os.sched_getaffinity(0))
    argv = ["e2e_gpu.py", "--model", str(kit), "--configs", "base,ours,noio", "--workloads", "smoke",
            "--warmup", "0", "--inner-repeats", "2", "--port", "31000", "--cpus", str(core),
            "--out", str(tmp_path / "e2e.json"), "--logs", str(tmp_path / "logs"), "--together"]
    monkeypatch.setattr(sys, "argv", argv)
    assert e2e.main() == 0

    kinds = [(k, c) for k, c, _ in _StandInServer.events]
    first_run = kinds.index(("run", "base"))
    assert sorted(c for k, c in kinds[:first_run]) == ["base", "noio", "ours"]  # all started
    # Every server told to stop before the first is waited for.
    assert [k for k, _ in kinds[first_run + len(runs):]] == ["terminate"] * 3 + ["stop"] * 3
    # A command cut off mid-launch keeps the runs made so far.
    assert saved == list(range(6))
    assert runs == ["base", "ours", "noio", "noio", "ours", "base"]
    idle = (os.sched_getaffinity(0) - {core}) or os.sched_getaffinity(0)
    turn = moves[:3]  # base's first turn: base on the chosen core, the others idle
    assert sorted(turn) == sorted([("base", {core}), ("ours", idle), ("noio", idle)])
    assert len(moves) == 3 * len(runs)
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert {c: len(data["runs"][c]["smoke"]) for c in ("base", "ours", "noio")} == \
        {"base": 2, "ours": 2, "noio": 2}
    assert {r["config"]: r["port"] for r in data["launches"]} == \
        {"base": 31000, "ours": 31007, "noio": 31014}

    monkeypatch.setattr(sys, "argv", argv + ["--parallel"])
    with pytest.raises(SystemExit):
        e2e.main()


@pytest.mark.parametrize("together", [True, False])
def test_prefill_warmup_sends_each_workload_its_longest_prompt_once(tmp_path, monkeypatch, together):
    """--warmup 2: before its measured runs every server prefills the
    workload's longest prompt once, for 2 tokens (the first full-size
    prefill builds its kernels, which the configuration measured first
    would otherwise pay alone); --warmup 1 runs the whole workload. With
    --freeze-gc (the second) each server's collector is frozen between its
    warm-up and its measured runs."""
    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    monkeypatch.setitem(sys.modules, "e2e_gpu", e2e)
    monkeypatch.setattr(e2e, "Server", _StandInServer)
    monkeypatch.setattr(e2e, "package_origin", lambda env: {"origin": "stand-in"})
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    groups, new, _ = e2e.WORKLOADS["smoke"]
    measured = sorted(n for g in groups for n in g)
    for warmup, unrecorded in (("2", [(max(measured), 2)]), ("1", [(n, new) for n in measured])):
        _StandInServer.events, _StandInServer.requests, _StandInServer.differs = [], [], None
        monkeypatch.setattr(sys, "argv", [
            "e2e_gpu.py", "--model", str(kit), "--configs", "base,ours", "--workloads", "smoke",
            "--warmup", warmup, "--port", "31000", "--out", str(tmp_path / "e2e.json"),
            "--logs", str(tmp_path / "logs")] + (["--together"] if together else [])
            + (["--freeze-gc"] if warmup == "1" else []))
        assert e2e.main() == 0
        for cfg in ("base", "ours"):
            got = [(n, k) for c, n, k in _StandInServer.requests if c == cfg]
            k = len(unrecorded)
            assert sorted(got[:k]) == sorted(unrecorded), (warmup, cfg, got)
            if warmup == "1":
                assert got[k] == ("freeze_gc", None)
                k += 1
            assert sorted(got[k:]) == [(n, new) for n in measured]  # the measured run
        launches = json.loads((tmp_path / "e2e.json").read_text())["launches"]
        assert [r.get("gc_frozen", False) for r in launches] == [warmup == "1"] * 2


def test_move_server_pins_every_thread_of_the_server_group():
    """move_server reaches every thread of every process in the server's
    process group (SGLang's scheduler polls from a thread of a child)."""
    import subprocess
    from types import SimpleNamespace

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    child = ("import subprocess, sys, threading, time\n"
             "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
             "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        deadline = time.time() + 20
        while len(e2e.group_threads(proc.pid)) < 3 and time.time() < deadline:
            time.sleep(0.1)
        tids = e2e.group_threads(proc.pid)
        assert proc.pid in tids and len(tids) >= 3  # main thread, its thread, the grandchild
        assert os.getpid() not in tids
        core = min(os.sched_getaffinity(0))
        e2e.move_server(SimpleNamespace(proc=proc), {core})
        assert all(os.sched_getaffinity(t) == {core} for t in e2e.group_threads(proc.pid))
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_bound_stage_passes_its_extra_flags_and_nothing_else(tmp_path):
    """gpu_stages.sh's bound_cmd: GF_BOUND_EXTRA's flags reach e2e_gpu.py
    (e.g. --check, issue #16's exactness item on the decode-bound
    workloads, or --step-timer); without it the stage times and checks
    nothing."""
    import subprocess

    function = stage_functions("v32_model", "bound_cmd")
    echoing_python3(tmp_path)  # model_config.py and e2e_gpu.py print their arguments

    def argv(**extra):
        env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "RUN": "/r", "WORK": "/w",
               "GF_BOUND_WORKLOADS": "decodelong", "GF_BOUND_CONFIGS": "ours", **extra}
        script = function + 'E2E=(python3 scripts/e2e_gpu.py --port 1); CPU_ARGS=(--cpu-probe); bound_cmd'
        p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True)
        return p.stdout.split()

    plain = argv()
    assert "--check" not in plain and "--step-timer" not in plain
    assert plain[plain.index("--model") + 1] == "/w/dsv32-8"
    assert plain[plain.index("--workloads") + 1] == "decodelong"
    for extra in (["--check"], ["--check", "--step-timer"]):
        got = argv(GF_BOUND_EXTRA=" ".join(extra))
        assert [a for a in got if a in extra] == extra
        assert [a for a in got if a not in extra] == plain  # nothing else changes


def test_client_gaps_reads_the_stand_in_both_ways(capsys):
    """scripts/client_gaps.py: the stand-in's streams end a tick apart and both
    readers see every token of each; the summary line compares them."""
    cg = _load("client_gaps", SCRIPTS / "client_gaps.py")
    port = 30000 + os.getpid() % 2000
    with cg.stand_in(port, 4, 6, 2.0) as url:
        after = cg.read_all(url, 4, 6, "after")
    assert sorted(len(r["output_ids"]) for r in after) == [5, 5, 6, 6]
    assert all(r["logprobs"] == [-0.5] * len(r["output_ids"]) for r in after)
    assert cg.main(["--streams", "4", "--tokens", "6", "--tick-ms", "2", "--rounds", "1",
                    "--port", str(port + 1)]) == 0
    out = capsys.readouterr().out
    assert "round 1 after" in out and "round 1 in-thread" in out and "in-thread / after" in out


def test_host_link_line_finds_the_gpus_numa_node_from_nvidia_smis_bus_id(monkeypatch):
    """nvidia-smi spells a bus id with an 8-digit domain (00000000:1A:00.0) and
    sysfs with 4 (0000:1a:00.0): the header line must read the GPU's node
    from sysfs all the same. Checked on a PCI device of this machine."""
    devices = sorted(Path("/sys/bus/pci/devices").glob("*:*:*.*"))
    if not devices or not (devices[0] / "numa_node").exists():
        pytest.skip("no PCI devices in this machine's sysfs")
    dev = devices[0]
    domain, rest = dev.name.split(":", 1)
    smi_spelling = f"{int(domain, 16):08X}:{rest.upper()}"
    bk = _load("bench_kernels_for_host_link", SCRIPTS / "bench_kernels.py")

    class Done:
        stdout = smi_spelling + "\n"

    monkeypatch.setattr("subprocess.run", lambda *a, **k: Done())
    monkeypatch.setattr(bk, "h2d_ceiling_gbps", lambda: 54.25)
    line = bk.host_link_line()
    node = (dev / "numa_node").read_text().strip()
    assert line.startswith("host link: pinned H2D 54.2 GB/s")
    assert f"GPU 0 on NUMA node {node} of " in line


def test_decode_stage_sizes_the_pool_from_gf_decode_tokens(tmp_path):
    """gpu_stages.sh's decode_cmd: the pool every configuration gets is
    --max-total-tokens GF_DECODE_TOKENS, 72000 unless set. The pool decides
    ours / native at 61 layers (native runs (pool - prompt) / hot + 1
    requests, ours pool / hot), so the next runs compare pools.
    GF_DECODE_JOIN bounds the wait for the running count."""
    import subprocess

    function = stage_functions("v32_model", "decode_cmd")
    echoing_python3(tmp_path)  # model_config.py and profile_decode.py print their arguments

    def extra(**env_more):
        env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "RUN": "/r", "WORK": "/w", "PORT": "1",
               **env_more}
        p = subprocess.run(["bash", "-c", function + "decode_cmd"], capture_output=True, text=True,
                           env=env, check=True)
        flags = p.stdout.split("--extra ", 1)[1].split(" --out")[0].split()
        return dict(zip(flags[::2], flags[1::2]), join=p.stdout.split("--join-timeout-s ")[1].split()[0]
                    if "--join-timeout-s" in p.stdout else None)

    assert extra()["--max-total-tokens"] == "72000"
    assert extra()["--mem-fraction-static"] == "0.45"
    got = extra(GF_DECODE_TOKENS="50000", GF_DECODE_MEM="0.5")
    assert got["--max-total-tokens"] == "50000" and got["--mem-fraction-static"] == "0.5"
    # The wait for the running count: profile_decode.py's own default unless set.
    assert got["join"] is None and extra(GF_DECODE_JOIN="150")["join"] == "150"


def test_every_configuration_is_one_row_of_the_table_and_its_server_carries_it(monkeypatch):
    """e2e_gpu.py's configurations live in one table (SERVER_CONFIGS): the
    module docstring describes each, and each server gets exactly the
    environment, flags and --check / --synthetic reach its row says; the
    lists the rest of the script reads are drawn from the table."""
    import re

    e2e = _load("e2e_gpu", SCRIPTS / "e2e_gpu.py")
    section = e2e.__doc__.split("Configurations:\n", 1)[1].split("\n\n", 1)[0]
    assert sorted(re.findall(r"^  ([a-z0-9]+)\s", section, re.M)) == sorted(e2e.CONFIGS)
    monkeypatch.setenv("PYTHONPATH", "/site")
    for name, spec in e2e.SERVER_CONFIGS.items():
        plain_args, plain_env = e2e.server_cmd("/m", 1, name, [], ref_pkg="/ref")
        args, env = e2e.server_cmd("/m", 1, name, [], ref_pkg="/ref", check=True, synthetic="calibrated",
                                   spec_flags=["--speculative-algorithm", "EAGLE"])
        assert all(env[k] == v for k, v in spec.env), name
        assert plain_args[len(plain_args) - len(spec.args):] == list(spec.args), name
        assert ("--enable-hisparse" in args) == spec.hisparse_flag, name
        assert (e2e.CHECK_ENV in env) == (spec.hisparse_flag and spec.our_plugin), name
        assert (env.get(e2e.SYNTHETIC_ENV) == "calibrated") == spec.synthetic, name
        assert ("--speculative-algorithm" in args) == spec.spec_flags, name
        assert ("SGLANG_PLUGINS" in env) == (not spec.our_plugin), name
        # nothing the row does not name: the environment beyond the check's,
        # the synthetic top-k's and the plugin list is the row's own.
        own = {k for k in plain_env if k not in os.environ or plain_env[k] != os.environ[k]}
        assert own - {"PYTHONPATH", "SGLANG_PLUGINS"} - set(e2e.ARCH_ENV["dsa"]) == {k for k, _ in spec.env}, name
    assert e2e.CHECK_EXPECT == {"noio": "mismatch", **{c: "exact" for c, s in e2e.SERVER_CONFIGS.items()
                                                        if s.expect == "exact"}}
    assert "native" in e2e.SYNTHETIC_CONFIGS and "native" not in e2e.CHECK_EXPECT
    assert e2e.PREFETCH_CONFIGS == ("ours", "warp", "prio16", "prio0")


def test_a_skipped_stage_names_the_budget_that_would_have_run_it(tmp_path):
    """gpu_stages.sh's run_stage: a stage with too little of GF_BUDGET_S left
    is skipped, and its summary says the GF_BUDGET_S that would have run it
    (the set-up, reserve and stop grace spend part of the budget; on
    2026-12-07-s8 three stages were skipped for want of it)."""
    import subprocess

    function = stage_functions("run_stage")

    def summary(budget, elapsed):
        env = {"PATH": os.environ["PATH"], "RUN": str(tmp_path), "BUDGET_S": str(budget), "RESERVE": "15"}
        script = (f"elapsed() {{ echo {elapsed}; }}\nsummarize_stage() {{ :; }}\n" + function
                  + "run_stage decode 200 560 echo ran")
        subprocess.run(["bash", "-c", script], env=env, check=True)
        return (tmp_path / "decode.summary").read_text()

    # 265 - 50 - 15 - 45 = 155 s left of the 200 needed: 310 would leave 200.
    text = summary(265, 50)
    assert "SKIPPED (155 s left, needs ~200 s: GF_BUDGET_S=310 would run it)" in text
    assert "rc=0" in summary(310, 50)
