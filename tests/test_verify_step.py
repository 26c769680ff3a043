"""The speculative verify step on CPU with real SGLang pools (engine/verify.py).

Each step does what 0.5.13's EAGLE worker does around the target's verify
forward, with SGLang's own allocator calls: the spec reserve takes logical
slots for the draft positions (``alloc_logical_only``, as a PD decode node's
prealloc does), ``map_slots`` points them at hot-buffer rows, the "forward"
writes each position's tag into the rows the mapping gives, the union
swap-in reads a random top-k per verify row, ``commit`` writes the rows
through, and an accept length of 1..n moves the committed length on.
Every read must return the tag of the position asked for, host rows must
hold every committed position's bytes, and finish / abort between the
steps must return every slot.
"""

import random

import pytest
import torch

from dataplane_fixtures import (
    PS, decode_batch, get_tag, kv_allocated_len, put_tag, set_kv_allocated_len,
    speculative_server_args, t64, verify_locs,
)
from sglang_hisparse.engine.state import ReqState
from test_coordinator import TOPK, Env

N = 4  # draft tokens: 3 steps, top-k 1


def _spec_reserve_seam_here() -> bool:
    """Whether the installed release has the spec reserve our hook wraps
    (0.5.13's EagleDraftInputV2Mixin.prepare_for_decode; 0.5.15 reshaped it)."""
    from sglang_hisparse.manifest import ENTRIES
    from sglang_hisparse.pinned_source import sglang_version

    (entry,) = [e for e in ENTRIES if e.impl == "sglang_hisparse.adapter.speculative:"
                                                "eagle_prepare_for_decode"]
    return entry.applies_to(sglang_version())


needs_spec_reserve_seam = pytest.mark.skipif(
    not _spec_reserve_seam_here(),
    reason="the installed release reshaped the spec reserve (0.5.15: eagle_utils."
           "eagle_prepare_for_decode); its seam comes with the MTP wiring")


def reserve(env, req, upto):
    """Logical slots for positions [kv_allocated_len, upto) (the spec reserve)."""
    idx, have = req.req_pool_idx, kv_allocated_len(req)
    if upto <= have:
        return
    last = env.r2t.req_to_token[idx, have - 1].to(torch.int64).reshape(1)
    locs = env.alloc.alloc_logical_only(t64(have), t64(have), t64(upto), t64(upto), last,
                                        upto - have)
    assert locs is not None
    env.r2t.req_to_token[idx, have:upto] = locs.to(torch.int32)
    set_kv_allocated_len(req, upto)


def reserved_verify_locs(env, reqs, committed):
    """The spec reserve for every request, then the step's verify slots."""
    for r, s in zip(reqs, committed):
        reserve(env, r, s + 2 * N)  # 0.5.13 reserves two steps ahead (get_alloc_reserve_per_decode)
    return verify_locs(env.r2t, reqs, committed, N)


def map_next_step(env, reqs, committed):
    """A step's reserve and ``map_slots``, its forward not run yet."""
    env.coord.verify.map_slots([r.req_pool_idx for r in reqs], [kv_allocated_len(r) for r in reqs],
                               t64(*committed), reserved_verify_locs(env, reqs, committed))


def check_verify_reads(env, req_pool_indices, committed, gen):
    """The union swap-in on random verify rows (each selects older positions
    and its own verified ones): every row reads the tags of what it selected."""
    n = N
    top = torch.full((len(committed) * n, TOPK), -1, dtype=torch.int32)
    for b, s in enumerate(committed):
        for j in range(n):
            pick = gen.sample(range(s + j + 1), min(TOPK, s + j + 1))
            top[b * n + j, :len(pick)] = torch.tensor(pick, dtype=torch.int32)
    env.coord.num_real_reqs.fill_(len(committed))
    seq_rows = t64(*[s + j + 1 for s in committed for j in range(n)])
    for layer in range(env.pool.layer_num):
        out = env.coord.swap_in_selected_pages(req_pool_indices, seq_rows, top, layer)
        for row in range(len(committed) * n):
            want = [t for t in top[row].tolist() if t >= 0]
            assert get_tag(env.pool.kv_buffer[layer], out[row, :len(want)]) == want, (layer, row)


def verify_step(env, reqs, committed, gen, accept=None):
    """One verify step; returns the new committed lengths."""
    coord, n = env.coord, N
    rpi = [r.req_pool_idx for r in reqs]
    locs = reserved_verify_locs(env, reqs, committed)
    coord.verify.map_slots(rpi, [kv_allocated_len(r) for r in reqs], t64(*committed), locs)
    rows = env.alloc.translate_to_physical(locs.reshape(-1))
    assert bool((rows > 0).all()), "a verify slot is unmapped"
    positions = torch.cat([torch.arange(s, s + n) for s in committed])
    for layer in range(env.pool.layer_num):  # the forward writes the verified tokens
        put_tag(env.pool.kv_buffer[layer], rows, positions)

    check_verify_reads(env, t64(*rpi), committed, gen)

    resident = [coord.residency.holds(r.req_pool_idx) for r in reqs]
    coord.verify.commit()
    mapping = env.alloc.full_to_hisparse_device_index_mapping
    new = []
    for b, (r, s) in enumerate(zip(reqs, committed)):
        kept = accept[b] if accept else gen.randint(1, n)  # accept_length + 1
        if resident[b]:
            # Its own rows: still mapped to what the forward wrote, nothing on host.
            assert bool((mapping[locs[b]] == rows.view(-1, n)[b]).all())
            assert int(coord.req_to_host_pool_allocated_len[r.req_pool_idx]) == 0
        else:
            assert int(mapping[locs[b]].abs().sum()) == 0
            host = coord.req_to_host_pool[r.req_pool_idx, :s + kept]
            assert get_tag(env.host.kv_buffer[1], host) == list(range(s + kept))
        r.kv_committed_len = s + kept
        new.append(s + kept)
    return new


@pytest.mark.parametrize("seed", range(3))
def test_every_accept_length_reads_and_writes_back_exactly(seed):
    # The in-server exactness check runs after every swap-in too.
    env = Env(phys=2048, draft_tokens=N, exactness_check=True)
    gen = random.Random(seed)
    # long, short, and one whose verify rows cross the buffer's end (B = 128)
    reqs = [env.staged("long", 300), env.staged("short", 40), env.staged("edge", 126)]
    env.coord.collect_ready_reqs()
    committed = [300, 40, 126]
    for step in range(40):
        accept = [(step + b) % N + 1 for b in range(3)]  # every length, every request
        committed = verify_step(env, reqs, committed, gen, accept if step < 8 else None)
    assert committed[1] > 128  # the short one grew past the buffer
    exact = env.coord.exactness.read()
    assert exact["exact_checked"] == 40 * 3 * N * TOPK * env.pool.layer_num
    assert exact["exact_mismatches"] == 0, env.coord.exactness.first_mismatch
    with speculative_server_args():
        for r in reqs:
            env.finish(r)
    assert env.drained()


def test_a_request_released_between_map_and_commit_is_not_written_back():
    """The commit writes only requests still decoding: one finished after
    map_slots has no host rows left (they went back to the pool)."""
    env = Env(phys=2048, draft_tokens=N)
    a, b = env.staged("a", 300), env.staged("b", 200)
    env.coord.collect_ready_reqs()
    locs = reserved_verify_locs(env, (a, b), (300, 200))
    env.coord.verify.map_slots([a.req_pool_idx, b.req_pool_idx],
                               [kv_allocated_len(a), kv_allocated_len(b)], t64(300, 200), locs)
    with speculative_server_args():
        env.finish(a)
    written = env.coord.host_bytes_written
    env.coord.verify.commit()
    assert env.coord.host_bytes_written - written == N * env.coord.item_size_bytes * env.pool.layer_num
    with speculative_server_args():
        env.finish(b)
    assert env.drained()


@pytest.mark.parametrize("when", ["after_map", "after_commit"])
def test_finish_or_abort_mid_step_returns_everything(when):
    env = Env(phys=2048, draft_tokens=N)
    gen = random.Random(7)
    a, b = env.staged("a", 200), env.staged("b", 90)
    env.coord.collect_ready_reqs()
    committed = verify_step(env, [a, b], [200, 90], gen)
    map_next_step(env, (a, b), committed)
    if when == "after_commit":
        env.coord.verify.commit()
    with speculative_server_args():
        env.finish(a)  # the verify slots of a step in flight are in kv_allocated_len
        env.finish(b)
    assert env.drained()


def test_a_verify_needs_its_tokens_in_the_page():
    with pytest.raises(ValueError, match="draft_tokens \\(65\\) must be <= the page size \\(64\\)"):
        Env(draft_tokens=65)


@needs_spec_reserve_seam
@pytest.mark.parametrize("hooked", [True, False])
def test_the_spec_reserve_takes_logical_slots_only(hooked):
    """0.5.13's own EagleDraftInputV2Mixin.prepare_for_decode reserves the
    next 2 x 4 positions per request (here past each prompt's last page);
    through our hook they get logical slots and no device row (without it,
    rows are taken)."""
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.eagle_info_v2 import EagleDraftInputV2Mixin

    from sglang_hisparse.adapter.speculative import eagle_prepare_for_decode

    env = Env(phys=2048, draft_tokens=N)
    reqs = [env.staged("a", 320), env.staged("b", 60)]
    env.coord.collect_ready_reqs()
    physical, logical = env.alloc.physical_available_size(), env.alloc.logical_available_size()
    batch = decode_batch(env.r2t, env.alloc, env.coord, reqs)
    original = EagleDraftInputV2Mixin.prepare_for_decode
    with speculative_server_args():
        if hooked:
            eagle_prepare_for_decode(original, EagleDraftInput(), batch)
        else:
            original(EagleDraftInput(), batch)
    assert [kv_allocated_len(r) for r in reqs] == [320 + 2 * N, 60 + 2 * N]
    assert env.alloc.logical_available_size() < logical
    new = torch.cat([env.r2t.req_to_token[r.req_pool_idx, n:n + 2 * N].to(torch.int64)
                     for r, n in zip(reqs, (320, 60))])
    mapped = int((env.alloc.translate_to_physical(new) != 0).sum())
    if hooked:
        assert env.alloc.physical_available_size() == physical and mapped == 0
    else:
        assert env.alloc.physical_available_size() < physical and mapped == new.numel()


def test_a_request_without_host_rows_is_not_written_back(monkeypatch):
    """Admission drifted and the host pool has no page for one request's
    verify positions: map_slots reports the drift and leaves it unmapped, and
    commit writes back only the requests it mapped."""
    env = Env(phys=2048, draft_tokens=N)
    a, b = env.staged("a", 320), env.staged("b", 200)
    env.coord.collect_ready_reqs()
    drifted = []
    env.coord.on_drift = lambda req, why: drifted.append((req.rid, why))
    host = env.coord.mem_pool_host
    real = type(host).try_alloc_paged_token_slots

    def no_page_for_a(self, table, lens, idx, start, count):
        return None if idx == a.req_pool_idx else real(self, table, lens, idx, start, count)

    monkeypatch.setattr(type(host), "try_alloc_paged_token_slots", no_page_for_a)
    locs = reserved_verify_locs(env, (a, b), (320, 200))
    rpi = [a.req_pool_idx, b.req_pool_idx]
    env.coord.verify.map_slots(rpi, [kv_allocated_len(a), kv_allocated_len(b)], t64(320, 200), locs)
    assert [rid for rid, _ in drifted] == ["a"] and "verify rows" in drifted[0][1]
    assert int((env.alloc.translate_to_physical(locs[0]) != 0).sum()) == 0
    written = env.coord.host_bytes_written
    env.coord.verify.commit()
    assert env.coord.host_bytes_written - written == N * env.coord.item_size_bytes * 2
    monkeypatch.undo()
    with speculative_server_args():
        env.finish(a)
        env.finish(b)
    assert env.drained()


# ------------------------------------------------------------- residency
# A resident's verify positions are its own rows (Residency.cover_reserve):
# the reserve's pages get physical pages, the forward writes there, the
# swap-in translates, the commit leaves it alone; demotion (admission or
# growth short of rows) hands it to the HOT path mid-run.

def resident_verify_env(phys):
    return Env(phys=phys, ratio=4, residency=True, draft_tokens=N, exactness_check=True)


def run_verify_steps(env, reqs, committed, gen, steps, first=0):
    for step in range(first, first + steps):
        accept = [(step + b) % N + 1 for b in range(len(reqs))]  # every length, every request
        committed = verify_step(env, reqs, committed, gen, accept)
    return committed


def assert_exact(env, entries):
    exact = env.coord.exactness.read()
    assert exact["exact_checked"] == entries
    assert exact["exact_mismatches"] == 0, env.coord.exactness.first_mismatch


def test_residents_verify_in_their_own_rows_then_admission_demotes_one():
    env = resident_verify_env(phys=1280)
    gen = random.Random(3)
    reqs = [env.staged("long", 300), env.staged("short", 40), env.staged("edge", 126)]
    assert env.coord.collect_ready_reqs() == reqs
    assert all(env.coord.state_of(r).is_resident for r in reqs)
    committed = run_verify_steps(env, reqs, [300, 40, 126], gen, 8)
    assert env.coord.host_bytes_written == 0 and env.coord.demotions == 0
    assert env.host.available_size() == env.start["host"]
    # Rows cover each reserve whole: page_up(kv_allocated_len).
    for r in reqs:
        assert env.coord.requests.record(r.req_pool_idx).resident_rows == \
            -(-kv_allocated_len(r) // PS) * PS
    # A 600-token prompt needs more rows than are free: the largest resident
    # is demoted (its KV up to kv_allocated_len to host) and verifies HOT.
    late = env.staged("late", 600)
    assert env.coord.demotions == 1 and env.coord.state_of(reqs[0]) is ReqState.HOT
    env.coord.collect_ready_reqs()
    reqs.append(late)
    committed = run_verify_steps(env, reqs, committed + [600], gen, 8, first=8)
    assert env.coord.state_of(reqs[0]) is ReqState.HOT
    assert_exact(env, 8 * (3 + 4) * N * TOPK * env.pool.layer_num)
    with speculative_server_args():
        for r in reqs:
            env.finish(r)
    assert env.drained()


def test_resident_growth_short_of_rows_demotes_inside_the_step():
    """No free rows for the next reserve's page: map_slots demotes the
    largest resident, which is mapped as HOT in the same step."""
    env = resident_verify_env(phys=768)
    gen = random.Random(5)
    reqs = [env.staged("a", 300), env.staged("b", 200), env.staged("c", 100)]
    env.coord.collect_ready_reqs()
    committed = run_verify_steps(env, reqs, [300, 200, 100], gen, 12)
    assert env.coord.demotions >= 1 and env.coord.state_of(reqs[0]) is ReqState.HOT
    assert env.coord.accounting_drifts == 0
    assert_exact(env, 12 * 3 * N * TOPK * env.pool.layer_num)
    with speculative_server_args():
        for r in reqs:
            env.finish(r)
    assert env.drained()


def retract(env, req):
    """0.5.13 ``release_req`` (what ``retract_decode`` runs per request)."""
    from sglang.srt.managers.schedule_batch import release_req
    from sglang.srt.server_args import get_global_server_args

    from dataplane_fixtures import chunk_cache

    release_req(req=req, remaing_req_count=0, server_args=get_global_server_args(),
                req_to_token_pool=env.r2t, token_to_kv_pool_allocator=env.alloc,
                tree_cache=chunk_cache(env.r2t, env.alloc), hisparse_coordinator=env.coord)


@pytest.mark.parametrize("how", ["finish", "retract"])
@pytest.mark.parametrize("when", ["after_map", "after_commit"])
def test_a_resident_released_mid_step_returns_everything(how, when):
    """Finish (or abort: the same release) or retraction of a resident and of
    a demoted request between map_slots and commit, or after the commit."""
    env = resident_verify_env(phys=1024)
    gen = random.Random(11)
    a, b = env.staged("a", 200), env.staged("b", 90)
    env.coord.collect_ready_reqs()
    committed = run_verify_steps(env, [a, b], [200, 90], gen, 2)
    env.coord.residency.demote(a.req_pool_idx, with_new_token=False)
    committed = run_verify_steps(env, [a, b], committed, gen, 1, first=2)
    assert env.coord.state_of(a) is ReqState.HOT and env.coord.state_of(b).is_resident
    map_next_step(env, (a, b), committed)
    if when == "after_commit":
        env.coord.verify.commit()
    with speculative_server_args():
        for r in (b, a):
            retract(env, r) if how == "retract" else env.finish(r)
        if when == "after_map":
            env.coord.verify.commit()  # nothing left to write back
    assert env.drained()


def test_cover_reserve_maps_every_page_of_a_long_reserve_whole():
    """A reserve several pages past the resident's rows: each logical page
    gets a physical page of its own, offset for offset."""
    env = resident_verify_env(phys=1024)
    a = env.staged("a", 60)
    env.coord.collect_ready_reqs()
    reserve(env, a, 60 + 200)
    env.coord.residency.cover_reserve([a.req_pool_idx], [kv_allocated_len(a)])
    assert env.coord.requests.record(a.req_pool_idx).resident_rows == 320
    logical = env.r2t.req_to_token[a.req_pool_idx, :260].to(torch.int64)
    # the last page past kv_allocated_len too (its logical slots follow position 259's)
    logical = torch.cat([logical, logical[-1] + torch.arange(1, 61)])
    rows = env.alloc.translate_to_physical(logical)
    assert bool((rows > 0).all()) and rows.unique().numel() == 320
    pages = rows.view(-1, PS)
    assert bool((pages - pages[:, :1] == torch.arange(PS)).all())  # whole physical pages
    assert env.alloc.physical_available_size() == 1024 - 320
    with speculative_server_args():
        env.finish(a)
    assert env.drained()
