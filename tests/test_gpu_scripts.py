"""The pure parts of the GPU scripts, on the CPU: how profile_decode.py
reads a trace, how e2e_gpu.py turns step-timer snapshots into a workload's
share and estimates a workload's limit, and the step-timer plugin itself. The next GPU session relies on
these numbers, so they are checked here rather than trusted on the device."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


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


def _spin(n):
    total = 0
    for i in range(n):  # own time, not a builtin's
        total += i
    return total


def test_step_profile_dumps_from_the_scheduler_thread_and_compares_by_name(monkeypatch, tmp_path):
    # The profile attributes what one configuration adds to a step: a
    # function only B runs must come out on top, per decode batch.
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
            _spin(300_000)  # warm-up: cleared by the reset below
            (out / "profile_reset").touch()
            clock[0] = 1.0
            Scheduler.process_batch_result(None)
            assert not (out / "profile_reset").exists()
            for _ in range(10):
                Scheduler.get_next_batch_to_run(1)
                _spin(1000)
                if extra:
                    _spin(20_000)
                Scheduler.process_batch_result(None)
            Scheduler.get_next_batch_to_run(None)  # idle: not profiled
            _spin(500_000)
            clock[0] = 2.0
            Scheduler.get_next_batch_to_run(1)
            Scheduler.process_batch_result(None)
        finally:
            prof.disable()
            monkeypatch.undo()
        return out

    a, b = one_config("a", False), one_config("b", True)
    rows = timer.compare_profiles(str(a), str(b))
    assert rows[1] == ("(batches)", 11, 11, 0)
    top = rows[2]
    assert "_spin" in top[0] and top[3] > 0 and top[2] > top[1]
    # Neither the warm-up nor the idle spin counts: 10 x (1000 [+ 20000]) steps.
    a_us, b_us = top[1] * 11, top[2] * 11
    assert b_us > 5 * a_us


def test_busiest_threads_finds_a_spinning_thread():
    # A thread spinning beside the scheduler slows it without showing in its
    # profile; the sampler must name it and scale by the real interval.
    import subprocess
    import time as _time

    prof = _load("profile_decode", SCRIPTS / "profile_decode.py")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _time.sleep(0.2)
        text = prof.busiest_threads(0.5)
    finally:
        spin.kill()
        spin.wait()
    row = next(line for line in text.splitlines() if f"pid {spin.pid:>7}" in line)
    assert float(row.split("%")[0]) > 40.0  # a whole core, less what a 2-core CI box shares
    assert float(row.split("%")[0]) < 130.0


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
    assert line.startswith("tiny        limit   ~95.7 tok/s (x1.91 base) = 4 prefills x 0.100 s")
    assert line.endswith("share of it: base 0.52, ours 0.84")
    assert rows[-1]["config"] == "limit" and abs(rows[1]["tok_s_vs_limit"] - 80 / (40 / 0.418)) < 1e-9
