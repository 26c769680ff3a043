"""The soak (scripts/soak.py) for 1000 steps on CPU, with residency (the
default) and without, parking on, and as a PD decode node: no leak, no
mismatch between the swap-in reference and the independent LRU model, every
selected row holding its token."""

import importlib.util
import json
from pathlib import Path

import pytest

from test_verify_step import needs_spec_reserve_seam

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def _load():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _counters(line):
    """The JSON line ``--verbose`` prints before the verdict: the soak's own
    counters and the coordinator's (demotions, ...) in one dict."""
    printed = json.loads(line)
    return printed, {**printed["coordinator"], **printed["stats"]}


def _never_zero(counters, keys):
    """The keys whose counter is zero (each names a path the run must take)."""
    return [k for k in keys if counters[k] == 0]


@pytest.mark.parametrize("residency", ["on", "off"])
def test_soak_1000_steps(capsys, residency):
    soak = _load()
    rc = soak.main(["--steps", "1000", "--seed", "7", "--residency", residency, "--verbose"])
    out = capsys.readouterr().out.strip().splitlines()
    verdict = out[-1]
    assert rc == 0, "\n".join(out)
    assert verdict.startswith(
        f"soak seed=7 steps=1000 mode=colocated device=cpu residency={residency} parking=on OK")
    for name in ("logical", "physical", "host", "req_slots"):
        assert f"{name} free" in verdict
    _, counts = _counters(out[-2])
    exercised = ["parked"]  # some staged requests waited on host
    if residency == "on":  # both paths were exercised, demotion included
        exercised += ["resident_checks", "demotions"]
    assert not _never_zero(counts, exercised), counts


def test_soak_pd_decode_retracts_to_host_and_resumes(capsys):
    # Every swap-in after a resume reads rows restored from host, the newest
    # token written through at retraction included.
    soak = _load()
    rc = soak.main(["--steps", "1000", "--seed", "11", "--mode", "pd", "--verbose"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, "\n".join(out)
    assert out[-1].startswith("soak seed=11 steps=1000 mode=pd device=cpu residency=on parking=on OK")
    _, counts = _counters(out[-2])
    assert not _never_zero(counts, ("transferred", "retract", "resumed", "abort_retracted")), counts


@needs_spec_reserve_seam  # the soak's verify steps reserve through it
@pytest.mark.parametrize("draft_tokens,seed", [(4, 1)])
def test_soak_speculative_verify_steps(capsys, draft_tokens, seed):
    # MTP/EAGLE: reserve through 0.5.13's prepare_for_decode in our hook,
    # verify slots, union swap-in of every row checked against the tags,
    # write-through, random acceptance; finish/abort between the mapping and
    # the commit, retraction, parking, residents and their demotions - and
    # every pool back at its start.
    soak = _load()
    rc = soak.main(["--steps", "300", "--seed", str(seed), "--speculative", str(draft_tokens),
                    "--verbose"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, "\n".join(out)
    assert out[-1].startswith(f"soak seed={seed} steps=300 mode=colocated device=cpu "
                              f"residency=on parking=on speculative={draft_tokens} OK")
    _, counts = _counters(out[-2])
    # Residents verify in their own rows and are demoted mid-run.
    assert not _never_zero(counts, ["verify_steps", "abort_in_verify", "retract", "parked",
                                    "misses", "resident_verify", "demotions"]), counts
    assert counts["accepted"] > counts["verify_steps"]  # more than one token a step


def test_a_zero_counter_fails_the_check_whichever_key_it_is():
    # The counters come back as a dict, so a zero in any position counts,
    # the last key included.
    soak = _load()
    stats = soak.Sim(seed=1).stats
    keys = list(stats)
    line = json.dumps({"stats": dict(stats, **{k: 1 for k in keys[:-1]}), "coordinator": {}})
    _, counts = _counters(line)
    assert _never_zero(counts, keys) == [keys[-1]]


def test_decode_steps_run_in_model_runner_order():
    # Per decode step as in a server: the batch is prepared (new slots, then
    # map_last_loc_to_buffer with its write-through), then the forward
    # waits for that write-through before the model writes the new tokens'
    # KV, then the layers swap in (0.5.13 ModelRunner.forward).
    soak = _load()
    sim = soak.Sim(seed=7)
    events = []

    def spy(obj, name, tag):
        """Record ``tag()`` at each call, then make the real call."""
        real = getattr(obj, name)

        def wrapper(*args, **kwargs):
            events.append(tag())
            return real(*args, **kwargs)
        setattr(obj, name, wrapper)

    for name in ("map_last_loc_to_buffer", "wait_for_pending_backup", "swap_in_selected_pages"):
        spy(sim.coord, name, lambda name=name: name)
    spy(sim, "write_kv", lambda: "write_kv" if sim.in_forward else "prefill_kv")
    for _ in range(150):
        sim.step()
    steps = []
    for i, e in enumerate(events):
        if e == "map_last_loc_to_buffer":
            j = events.index("swap_in_selected_pages", i)
            steps.append(events[i:j + 1])
    assert len(steps) == sim.stats["decode_steps"] > 100
    for step in steps:
        body = step[2:-1]
        assert step[:2] == ["map_last_loc_to_buffer", "wait_for_pending_backup"], step
        assert body and set(body) == {"write_kv"}, step
    sim.drain()
    assert sim.leak_report()[0]


def test_soak_detects_a_leak():
    soak = _load()
    sim = soak.Sim(seed=1)
    for _ in range(30):
        sim.step()
    sim.host.alloc_page(1)  # a page nobody owns
    sim.drain()
    ok, parts = sim.leak_report()
    assert not ok and any(p.startswith("host free") for p in parts)


# On the GPU the coordinator runs as in a server: our JIT swap-in kernel,
# SGLang's Triton allocator kernels (not interpreted), staging and
# write-through on their own streams, the forward (KV writes, swap-ins) on
# the decode producer stream, pinned host memory. The same checks read every
# selected row and LRU back from the device.
GPU_RUNS = {
    "resident": (["--seed", "7"], ("resident_checks", "demotions", "parked", "retract")),
    "staged": (["--seed", "3", "--residency", "off"], ("parked", "abort_staging", "retract")),
    "pd": (["--seed", "11", "--mode", "pd"], ("transferred", "resumed", "abort_retracted")),
    # MTP verify rows (4 draft tokens) through the JIT union swap-in
    "speculative": (["--seed", "5", "--speculative", "4", "--hot", "256"],
                    ("verify_steps", "resident_verify", "abort_in_verify")),
}
# Its verify steps reserve through the spec seam, which not every pin has
# wired (as test_soak_speculative_verify_steps; seen on 0.5.17 on the H200).
GPU_RUN_MARKS = {"speculative": [needs_spec_reserve_seam]}


@pytest.mark.gpu
@pytest.mark.jit
@pytest.mark.parametrize("name", [pytest.param(n, marks=GPU_RUN_MARKS.get(n, []))
                                  for n in sorted(GPU_RUNS)])
def test_soak_on_gpu(name):
    import os
    import subprocess
    import sys

    args, exercised = GPU_RUNS[name]
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--top-k", "64", "--hot", "128",
         "--steps", "400", "--verbose", *args],
        env=env, capture_output=True, text=True, timeout=1200)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    verdict, (printed, counts) = lines[-1], _counters(lines[-2])
    print(lines[-2], verdict, sep="\n")
    assert " device=cuda " in verdict and " OK: " in verdict
    assert printed["swap_in"] == "sglang_hisparse.kernels.swap_in (JIT)"
    assert printed["producer_stream"]  # the forward ran on the decode producer stream
    assert not _never_zero(counts, ("swap_checks",) + exercised), counts


def test_soak_refuses_a_hot_buffer_the_server_would_refuse(capsys):
    # 128 slots cannot hold 4 verify rows x top-k 64: the server's config
    # rules say so, and a soak run with it reported a mismatch instead.
    soak = _load()
    with pytest.raises(SystemExit):
        soak.main(["--steps", "1", "--top-k", "64", "--hot", "128", "--speculative", "4"])
    assert "device_buffer_size must be in [draft_tokens x top_k (4 x 64)" in capsys.readouterr().err
