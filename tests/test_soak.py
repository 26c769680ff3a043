"""The CPU soak (scripts/soak_cpu.py) for 1000 steps: no leak, no mismatch
between the swap-in reference and the independent LRU model."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak_cpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("soak_cpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_1000_steps(capsys):
    soak = _load()
    rc = soak.main(["--steps", "1000", "--seed", "7", "--verbose"])
    out = capsys.readouterr().out.strip().splitlines()
    verdict = out[-1]
    assert rc == 0, "\n".join(out)
    assert verdict.startswith("soak seed=7 steps=1000 OK")
    for name in ("logical", "physical", "host", "req_slots"):
        assert f"{name} free" in verdict


def test_soak_detects_a_leak():
    soak = _load()
    sim = soak.Sim(seed=1)
    for _ in range(30):
        sim.step()
    sim.host.alloc_page(1)  # a page nobody owns
    sim.drain()
    ok, parts = sim.leak_report()
    assert not ok and any(p.startswith("host free") for p in parts)
