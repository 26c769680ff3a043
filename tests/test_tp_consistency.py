"""TP ranks make the same decisions although their copies finish at
different times (#22, the part a CPU can show).

Two processes join one gloo group and run the same schedule on their own
coordinator (real 0.5.13 pools on CPU): prompts are staged at fixed steps,
the scheduler's prefill demand keeps some of them parked for a while, and
running requests finish a fixed number of steps after joining. What
differs per rank is only how many polls each staging copy takes (as on GPUs
whose copies finish in different orders). Every step, both ranks must join
the same requests and park the same ones, with one collective at most per
step and none while nothing is being copied. Without the group (each rank
on its own) the same timings make the ranks' batches differ: the test can
fail.
"""

from __future__ import annotations

from conftest import run_ranks

LENGTHS = {"a": 300, "b": 250, "c": 200, "d": 280, "e": 150, "f": 320}
# Three prompts early, whose copies finish while the demand still parks
# them (parked with nothing in copy: no collective), three later.
ARRIVALS = {0: ["a", "b"], 1: ["c"], 16: ["d"], 17: ["e"], 19: ["f"]}
STEPS, LIFETIME, DEMAND_UNTIL = 36, 3, 14


def run_rank(rank: int, world: int, init_file: str, grouped: bool) -> dict:
    """One rank's run of the schedule; returns what it decided each step."""
    import random

    import torch
    import torch.distributed as dist

    from sglang_hisparse.engine.policies.parking import PrefillDemand
    from test_coordinator import Env

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    collectives = [0]
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        collectives[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    env = Env(phys=2048, tp_group=dist.group.WORLD if grouped else None)
    coord = env.coord
    timing = random.Random(1000 + rank)  # the only thing that differs per rank
    coord.set_cpu_staging_delay(lambda: timing.choice([0, 1, 3]))
    running, joined_at, step_now = {}, {}, [0]
    coord.set_prefill_demand(lambda: PrefillDemand(
        in_flight_rows=1500 if step_now[0] < DEMAND_UNTIL else 0, next_tokens=0,
        running=len(running), max_running=8))
    steps = []
    for step in range(STEPS):
        step_now[0] = step
        for rid in ARRIVALS.get(step, []):
            env.staged(rid, LENGTHS[rid])
        copying = bool(coord.ack_staging_queue)
        before = collectives[0]
        joined = coord.collect_ready_reqs()
        for req in joined:
            running[req.rid] = req
            joined_at[req.rid] = step
        for rid in [r for r, at in joined_at.items() if at == step - LIFETIME]:
            env.finish(running.pop(rid))
        steps.append(dict(
            joined=sorted(r.rid for r in joined),
            parked=sorted(r.rid for r in coord.parked_requests()),
            copying=copying, collectives=collectives[0] - before))
    for req in list(running.values()):
        env.finish(req)
    dist.destroy_process_group()
    return dict(steps=steps, drained=env.drained(), all_done=len(joined_at) == len(LENGTHS))


def _run_ranks(tmp_path, grouped: bool) -> list[dict]:
    init = str(tmp_path / f"init-{grouped}")
    return run_ranks("test_tp_consistency",
                     [f"run_rank({rank}, 2, {init!r}, {grouped})" for rank in range(2)])


def test_ranks_join_and_park_the_same_requests_every_step(tmp_path):
    r0, r1 = _run_ranks(tmp_path, grouped=True)
    for s, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        assert (a["joined"], a["parked"]) == (b["joined"], b["parked"]), (s, a, b)
        # one collective at most, and none unless a copy is in flight
        assert a["collectives"] <= int(a["copying"]) and b["collectives"] <= int(b["copying"])
    assert any(s["parked"] for s in r0["steps"]), "the schedule never parked: it tests nothing"
    assert any(not s["copying"] and s["parked"] for s in r0["steps"])  # parked, no collective
    assert r0["all_done"] and r1["all_done"] and r0["drained"] and r1["drained"]


def test_without_the_group_the_same_timings_diverge(tmp_path):
    r0, r1 = _run_ranks(tmp_path, grouped=False)
    assert [s["joined"] for s in r0["steps"]] != [s["joined"] for s in r1["steps"]]
