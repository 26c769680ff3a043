"""The request state machine: every legal move, and an illegal one raises."""

import pytest

from dataplane_fixtures import make_req
from sglang_hisparse.engine.state import (
    TRANSITIONS,
    IllegalTransition,
    ReqState,
    RequestTable,
)

S = ReqState


def _req(rid, idx):
    req = make_req(rid, 64)
    req.req_pool_idx = idx
    return req


def test_every_state_is_reachable_and_can_be_released():
    reachable, frontier = set(), {None}
    while frontier:
        nxt = set()
        for s in frontier:
            nxt |= set(TRANSITIONS[s]) - reachable
        reachable |= nxt
        frontier = {s for s in nxt if s is not None}
    assert reachable == set(ReqState) | {None}
    assert all(None in TRANSITIONS[s] for s in ReqState)


@pytest.mark.parametrize("frm", list(ReqState))
def test_moves_follow_the_table(frm):
    for to in ReqState:
        table = RequestTable()
        req = _req("a", 3)
        path = _path_to(frm)
        table.admit(req, path[0])
        for s in path[1:]:
            table.move(req, s)
        if to in TRANSITIONS[frm]:
            table.move(req, to)
            assert table.state_of(req) is to
            assert req.hisparse_staging == to.outside_batch
            assert table.in_state(to) == [req]
        else:
            with pytest.raises(IllegalTransition, match=f"from {frm.value} to {to.value}"):
                table.move(req, to)
            assert table.state_of(req) is frm


def _path_to(target):
    # Shortest admission path to `target` (BFS over TRANSITIONS).
    paths = {s: [s] for s in TRANSITIONS[None]}
    while target not in paths:
        for s, p in list(paths.items()):
            for t in TRANSITIONS[s]:
                if t is not None and t not in paths:
                    paths[t] = p + [t]
    return paths[target]


def test_a_slot_holds_one_request_and_order_is_kept():
    table = RequestTable()
    a, b, c = _req("a", 1), _req("b", 2), _req("c", 3)
    for r in (a, b, c):
        table.admit(r, S.STAGING)
    table.move(c, S.PARKED)
    table.move(a, S.PARKED)
    assert table.in_state(S.PARKED) == [c, a]  # the order they parked in
    with pytest.raises(IllegalTransition, match="still holds a"):
        table.admit(_req("a2", 1), S.HOT)
    other = _req("b", 2)  # same slot, another request object
    assert table.release(other) is None and table.holds(b)
    assert table.release(b).state is S.STAGING and not table.holds(b)
    assert table.count(S.STAGING) == 0 and len(table) == 2
