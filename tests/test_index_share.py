"""IndexShare: layer roles from the model config, lockstep tables, plan replay (CPU).

* roles: read from SGLang's real ``ModelConfig`` of the config-only tiny
  DeepSeek-V3.2 given ``index_topk_pattern`` / ``index_topk_freq`` /
  ``index_skip_topk_offset``, against what 0.5.13's model code computes
  (``DeepseekV2AttentionMLA.__init__``, hash-pinned in the manifest);
* the reference: a shared layer swapped in synchronously makes its anchor's
  decisions again (same outputs, slot tables, LRU), and replaying the
  anchor's miss plan on the shared layer's pools gives the same bytes;
* the coordinator on 0.5.13's real pools: with the prefetch, every layer's
  outputs and every byte of every layer's device pool equal those of the
  synchronous coordinator (``SGLANG_HISPARSE_INDEXSHARE_PREFETCH=0``),
  with hot buffers, residents, a PD-decode admission and parking, and the
  in-server exactness check finds no row wrong; every slot drains.
"""

import json
import shutil

import pytest
import torch

from dataplane_fixtures import (
    PS, TINY_MODEL, decode_step, dsa_pool, free_counts, make_req, pre_alloc, prefill, put_tag,
    release, req_pool,
)
from kernel_cases import make_case, refresh_top_k
from sglang_hisparse.config import (INDEXSHARE_PREFETCH_ENV, PREFETCH_GRID_ENV, PREFETCH_PRIORITY_ENV,
                                    env_problems)
from sglang_hisparse.engine.index_share import (
    IndexShareConfigError,
    LayerRoles,
    Role,
    prefetch_off_reason,
    roles_from_config,
)
from sglang_hisparse.kernels import reference as ref

# --------------------------------------------------------------- roles


def _model_config(tmp_path, **fields):
    """SGLang's ModelConfig of the tiny model with these config.json fields."""
    from sglang.srt.configs.model_config import ModelConfig

    d = tmp_path / "model"
    shutil.copytree(TINY_MODEL, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))
    return ModelConfig(str(d))


def _model_code_pattern(n, freq=1, offset=None, pattern=None):
    """0.5.13 deepseek_v2.py:1563-1597, one layer at a time, as written there."""
    out = ""
    for layer_id in range(n):
        if pattern is not None:
            skip = pattern[layer_id] == "S"
        elif offset is not None:
            skip = max(layer_id - offset + 1, 0) % freq != 0
        else:
            skip = max(layer_id - 1, 0) % freq != 0
        out += "S" if skip else "F"
    return out


@pytest.mark.parametrize("fields, want", [
    ({}, "FFFF"),
    ({"index_topk_pattern": "FSSS"}, "FSSS"),
    ({"index_topk_pattern": "FSFS"}, "FSFS"),
    ({"index_topk_pattern": "FSFSxx"}, "FSFS"),  # longer than the layers: the prefix
    ({"index_topk_pattern": "FxSS"}, "FFSS"),  # any letter but S runs the indexer
    ({"index_topk_freq": 2}, "FFSF"),
    ({"index_topk_freq": 3}, "FFSS"),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 3}, "FFFS"),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, "FSFS"),
])
def test_roles_from_the_real_model_config(tmp_path, fields, want):
    text = _model_config(tmp_path, **fields).hf_text_config
    roles = roles_from_config(text, text.num_hidden_layers)
    assert roles.pattern == want
    assert want == _model_code_pattern(
        4, fields.get("index_topk_freq", 1), fields.get("index_skip_topk_offset"),
        fields.get("index_topk_pattern"))


def test_glm52_like_layout():
    # 78 layers, 21 anchors: the anchor every 4th layer after 3 leading ones
    pattern = "FFF" + "FSSS" * 18 + "F" * 3
    roles = LayerRoles.from_pattern(pattern)
    assert roles.num_layers == 78 and sum(r is Role.ANCHOR for r in roles.roles) == 24
    assert roles.anchor_of[3:8] == (3, 3, 3, 3, 7)
    for anchor, shared in roles.followers.items():
        assert all(roles.anchor_of[s] == anchor for s in shared)
        assert shared == tuple(range(anchor + 1, anchor + 1 + len(shared)))


@pytest.mark.parametrize("fields, field", [
    ({"index_topk_pattern": "FSS"}, "index_topk_pattern"),  # shorter than 4 layers
    ({"index_topk_pattern": "SFFF"}, "index_topk_pattern"),  # layer 0 has nothing to reuse
    ({"index_topk_freq": 2, "index_skip_topk_offset": 0}, "index_skip_topk_offset"),
    ({"index_topk_freq": 0}, "index_topk_freq"),
])
def test_bad_index_sharing_names_the_field_before_weights(tmp_path, fields, field):
    """The check before weights uses the installed release's rules: a
    pattern shorter than the model fails on 0.5.13's model code (refused
    by name) and is valid on 0.5.15.post1's (its tail layers anchor)."""
    from sglang_hisparse.adapter import releases
    from sglang_hisparse.adapter.args import index_share_problems

    model_config = _model_config(tmp_path, **fields)
    with pytest.raises(IndexShareConfigError, match=field):
        roles_from_config(model_config.hf_text_config, 4)
    rules = releases.current.index_share_rules()
    try:
        roles_from_config(model_config.hf_text_config, 4, rules)
    except IndexShareConfigError:
        (problem,) = index_share_problems(model_config)
        assert field in problem
    else:
        # only the short pattern is a 0.5.15 edge (test_roles_follow_each_release_line)
        assert fields == {"index_topk_pattern": "FSS"}
        assert index_share_problems(model_config) == []


def _model_code_pattern_0_5_15(config, n):
    """0.5.15.post1 configs/model_config.py:180-200 (dsa_layer_skips_topk), as written there."""
    out = ""
    for layer_id in range(n):
        pattern = getattr(config, "index_topk_pattern", None)
        if pattern is not None:
            skip = layer_id < len(pattern) and pattern[layer_id] == "S"
        else:
            freq = getattr(config, "index_topk_freq", 1)
            freq = 1 if freq is None else freq
            offset = getattr(config, "index_skip_topk_offset", None)
            skip = (max(layer_id - offset + 1, 0) % freq != 0 if offset is not None
                    else max(layer_id - 1, 0) % freq != 0)
        out += "S" if skip else "F"
    return out


@pytest.mark.parametrize("fields", [
    {"index_topk_pattern": "FSS"},  # shorter than the model: 0.5.15 makes layer 3 an anchor
    {"index_topk_freq": None},  # 0.5.15 reads it as 1
    {"index_topk_pattern": "FSFS"},
    {"index_topk_freq": 2, "index_skip_topk_offset": 1},
])
def test_roles_follow_each_release_line(tmp_path, fields):
    """The per-release rules (adapter/releases): 0.5.15.post1's edges are
    what its dsa_layer_skips_topk computes; 0.5.13's model code fails on
    them (IndexError / TypeError), so its rules refuse them by name."""
    from sglang_hisparse.adapter.releases import module_for

    text = _model_config(tmp_path, **fields).hf_text_config
    rules_15 = module_for("0.5.15.post1").index_share_rules()
    assert roles_from_config(text, 4, rules_15).pattern == _model_code_pattern_0_5_15(text, 4)
    rules_13 = module_for("0.5.13.post1").index_share_rules()
    edge = "index_topk_pattern" if "index_topk_pattern" in fields and \
        len(fields["index_topk_pattern"]) < 4 else "index_topk_freq" if \
        fields.get("index_topk_freq", 1) is None else None
    if edge is None:
        assert roles_from_config(text, 4, rules_13) == roles_from_config(text, 4, rules_15)
    else:
        with pytest.raises(IndexShareConfigError, match=edge):
            roles_from_config(text, 4, rules_13)


@pytest.mark.parametrize("factor,pattern", [(2, "FSFSF"), (3, "FSSFS"), (1, "FSSSS")])
def test_0_5_17_reads_cli_factor_first(tmp_path, factor, pattern):
    """0.5.17's DeepseekV2AttentionMLA.__init__: cli_factor > 1 makes every
    cli_factor-th layer an anchor, whatever the other fields say; 1 leaves
    them to dsa_layer_skips_topk (here index_topk_pattern). Earlier releases
    never read it."""
    from sglang_hisparse.adapter.releases import module_for

    text = _model_config(tmp_path / "ok", cli_factor=factor,
                         index_topk_pattern="FSSSS").hf_text_config
    assert roles_from_config(text, 5, module_for("0.5.17").index_share_rules()).pattern == pattern
    assert roles_from_config(text, 5, module_for("0.5.15.post1").index_share_rules()).pattern \
        == "FSSSS"
    with pytest.raises(IndexShareConfigError, match="cli_factor"):
        bad = _model_config(tmp_path / "bad", cli_factor=None).hf_text_config
        roles_from_config(bad, 5, module_for("0.5.17").index_share_rules())


def test_prefetch_off_reasons():
    roles = LayerRoles.from_pattern("FSFS")
    kw = dict(is_deepseek_v4=False, pp_size=1, environ={})
    assert prefetch_off_reason(roles, **kw) is None
    assert prefetch_off_reason(roles, **{**kw, "environ": {INDEXSHARE_PREFETCH_ENV: "1"}}) is None
    assert "=0" in prefetch_off_reason(roles, **{**kw, "environ": {INDEXSHARE_PREFETCH_ENV: "0"}})
    assert "pipeline" in prefetch_off_reason(roles, **{**kw, "pp_size": 2})
    assert "DeepSeek-V4" in prefetch_off_reason(roles, **{**kw, "is_deepseek_v4": True})
    assert "no layer" in prefetch_off_reason(LayerRoles.from_pattern("FFFF"), **kw)
    assert "no layer" in prefetch_off_reason(None, **kw)
    assert env_problems({INDEXSHARE_PREFETCH_ENV: "off"}) == [
        f"{INDEXSHARE_PREFETCH_ENV}='off' is not valid; allowed: 0, 1"]


# ----------------------------------------------------- reference lockstep


def _plan(bs, width):
    return dict(miss_src=torch.full((bs, width), -5, dtype=torch.int64),
                miss_dst=torch.full((bs, width), -5, dtype=torch.int32),
                miss_count=torch.full((bs,), -5, dtype=torch.int32))


def _shared_layer_of(anchor, seed):
    """The shared layer of ``anchor``: one table, its own host and device
    bytes (each resident slot holds its token's bytes of this layer)."""
    gen = torch.Generator().manual_seed(seed)
    shared = anchor.clone()
    shared.host_kv = torch.randint(0, 256, anchor.host_kv.shape, dtype=torch.uint8, generator=gen)
    for r in range(anchor.slot_tokens.size(0)):
        held = anchor.slot_tokens[r] >= 0
        toks = anchor.slot_tokens[r][held].long()
        ref.write_rows(shared.device_kv, anchor.slot_locs[r][held].long(),
                       ref.read_rows(shared.host_kv, anchor.host_locs[r][toks]))
    return shared


def _lockstep_step(anchor, shared, replayed, draft_tokens=1):
    """One step: the anchor records its plan, the shared layer swaps in
    synchronously, the plan is replayed on ``replayed`` (the shared layer's
    pool before the step). Returns the misses moved."""
    rows, top_k = anchor.top_k_tokens.shape
    plan = _plan(rows // draft_tokens, draft_tokens * top_k)
    ref.swap_in(*anchor.args(), **plan, draft_tokens=draft_tokens)
    shared.top_k_tokens.copy_(anchor.top_k_tokens)
    ref.swap_in(*shared.args(), draft_tokens=draft_tokens)
    for name in ("out", "slot_tokens", "lru"):
        assert torch.equal(getattr(shared, name), getattr(anchor, name)), name
    ref.copy_planned(**plan, num_real_reqs=anchor.num_real_reqs, host_kv=shared.host_kv,
                     device_kv=replayed)
    assert torch.equal(replayed, shared.device_kv)
    real = int(anchor.num_real_reqs[0])
    assert (plan["miss_count"][real:] == 0).all()  # padding rows move nothing
    return int(plan["miss_count"].sum())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reference_shared_layer_is_the_anchors_plan_replayed(seed):
    """Step after step, a shared layer's synchronous swap-in makes its
    anchor's decisions (outputs, slot tables, LRU), and replaying the
    anchor's miss plan on a copy of its pools moves exactly its bytes."""
    anchor = make_case(seq_lens=[900, 40, 2000, 700, 129], top_k=64, hot=128, page=PS,
                       miss_rate=0.6, item_bytes=64, seed=seed, duplicates=3, pad_top_k=5,
                       num_real=4)
    shared = _shared_layer_of(anchor, seed + 100)
    replayed = shared.device_kv.clone()
    moved = 0
    for step in range(6):
        moved += _lockstep_step(anchor, shared, replayed)
        refresh_top_k(anchor, seed=seed * 10 + step, miss_rate=0.6)
    assert moved > 0


def test_reference_verify_rows_replay():
    """Speculative verify (2 rows a request): one union plan per request,
    2 x top_k wide, replays the same way."""
    from kernel_cases import make_verify_case

    anchor = make_verify_case(committed=[900, 700, 300], draft_tokens=2, top_k=32, hot=128,
                              page=PS, seed=9)
    shared = _shared_layer_of(anchor, 19)
    assert _lockstep_step(anchor, shared, shared.device_kv.clone(), draft_tokens=2) > 0


# ---------------------------------------------------- coordinator lockstep

HOT, TOPK, LAYERS = 128, 16, 4


class World:
    """One coordinator on real 0.5.13 pools with ``LAYERS`` layers, driven
    through SGLang's own prepare_for_decode."""

    def __init__(self, roles, *, prefetch, monkeypatch, phys=2048, residency=False,
                 pd_decode=False, exactness=False, parking=False):
        from sglang_hisparse.adapter.model_runner import HiSparseCoordinator
        from sglang_hisparse.pools.allocator import HiSparseDualAllocator

        self.pool = dsa_pool(phys, layers=LAYERS)
        self.r2t = req_pool(8, 2048)
        self.alloc = HiSparseDualAllocator(phys, PS, torch.bfloat16, "cpu", self.pool, False, 2)
        with monkeypatch.context() as m:
            m.setenv(INDEXSHARE_PREFETCH_ENV, "1" if prefetch else "0")
            self.coord = HiSparseCoordinator(
                self.r2t, self.alloc, TOPK, HOT, "cpu", None, 2, host_pool=None,
                residency=residency, parking=parking, pd_decode=pd_decode,
                exactness_check=exactness, index_roles=roles)
        assert (self.coord.prefetch is not None) == prefetch
        self.host = self.coord.mem_pool_host
        # The host pool is allocated uninitialized (as a server's is: the model
        # writes whole rows); the tags below fill a few columns of each row,
        # and the worlds' device pools are compared whole, so the rest of the
        # rows a swap-in copies must not be whatever an earlier test left in
        # that memory (the 0.5.17 port's run met a tag at column 544).
        for buf in self.host.kv_buffer:
            buf.zero_()
        self.start = free_counts(self.alloc, self.host, self.r2t)

    def staged(self, rid, n):
        req = make_req(rid, n)
        prefill(self.r2t, self.alloc, req, n, pool=self.pool)
        self.coord.admit_request_into_staging(req)
        return req

    def from_host(self, rid, n):
        req = make_req(rid, n)
        host = pre_alloc(self.r2t, self.alloc, self.coord, req)
        for layer in range(LAYERS):
            put_tag(self.host.kv_buffer[layer], host[:n], torch.arange(n))
            self.host.kv_buffer[layer][host[:n], 0, 1] = float(layer + 1)
        self.coord.admit_request_direct(req)
        return req

    def decode(self, reqs, top_k_of):
        """One decode step; every layer's swap-in in order, a shared layer
        given its anchor's top-k as the model hands it on. Returns each
        layer's output."""
        rpi, seq, out = decode_step(self.r2t, self.alloc, self.coord, reqs)
        rows = self.alloc.translate_to_physical(out)
        self.coord.num_real_reqs.fill_(len(reqs))  # as ModelRunner.forward does
        outs, top = [], None
        for layer in range(LAYERS):  # the layer's forward writes its new token first
            put_tag(self.pool.kv_buffer[layer], rows, seq - 1)
            self.pool.kv_buffer[layer][rows, 0, 1] = float(layer + 1)
            if not self.coord.index_roles.is_shared[layer]:
                top = top_k_of(layer, seq)
            outs.append(self.coord.swap_in_selected_pages(rpi, seq, top, layer).clone())
        return outs

    def finish(self, req):
        self.coord.request_finished(req)
        release(self.r2t, self.alloc, req)

    def drained(self):
        return (free_counts(self.alloc, self.host, self.r2t) == self.start
                and not self.coord.live_request_slots())


def _top_k_drawer(seed):
    gen = torch.Generator().manual_seed(seed)

    def draw(layer, seq):
        rows = []
        for n in seq.tolist():
            pick = torch.randperm(n, generator=gen)[:TOPK].to(torch.int32)
            row = torch.full((TOPK,), -1, dtype=torch.int32)
            row[:pick.numel()] = pick
            if pick.numel() == TOPK:
                row[0] = n - 1  # the newest token, as the indexer always picks it
                row[-1] = -1  # and some padding
            rows.append(row)
        return torch.stack(rows)
    return draw


@pytest.mark.parametrize("pattern", ["FSSS", "FSFS", "FFSS"])
@pytest.mark.parametrize("residency", [False, True])
def test_prefetch_equals_synchronous_swap_in(pattern, residency, monkeypatch):
    roles = LayerRoles.from_pattern(pattern)
    worlds = [World(roles, prefetch=p, monkeypatch=monkeypatch, residency=residency,
                    pd_decode=True, exactness=p) for p in (True, False)]
    reqs = []
    for w in worlds:
        rs = [w.staged("long", 300), w.staged("short", 60), w.from_host("pd", 400)]
        w.coord.collect_ready_reqs()
        reqs.append(rs)
    fetched, sync = worlds
    assert fetched.coord.prefetch.followers == roles.followers
    for step in range(10):
        if step == 6:  # one finishes mid-run
            for w, rs in zip(worlds, reqs):
                w.finish(rs.pop(1))
        outs = [w.decode(rs, _top_k_drawer(step)) for w, rs in zip(worlds, reqs)]
        for layer in range(LAYERS):
            assert torch.equal(outs[0][layer], outs[1][layer]), (step, layer)
            assert torch.equal(fetched.pool.kv_buffer[layer], sync.pool.kv_buffer[layer]), \
                (step, layer)
        c = sync.coord
        for layer in range(LAYERS):  # synchronous shared layers stay in lockstep
            a = roles.anchor_of[layer]
            assert torch.equal(c.req_device_buffer_tokens[layer], c.req_device_buffer_tokens[a])
            assert torch.equal(c.lru_slots[layer], c.lru_slots[a])
            t = fetched.coord.table_layer(layer)
            assert t == a
            assert torch.equal(fetched.coord.req_device_buffer_tokens[t],
                               c.req_device_buffer_tokens[layer])
    stats = fetched.coord.get_hisparse_stats()
    assert stats["exact_checked"] > 0 and stats["exact_mismatches"] == 0
    assert stats["misses"] > 0  # the PD request is never resident: its misses were replayed
    # A shared layer's replayed misses count as a synchronous swap-in's would.
    want = sync.coord.get_hisparse_stats()
    for key in ("hits", "misses", "host_bytes_read"):
        assert stats[key] == want[key], (key, stats[key], want[key])
    shared_layers = sum(roles.is_shared)
    assert fetched.coord.prefetch.replays == 10 * shared_layers
    for w, rs in zip(worlds, reqs):
        for r in rs:
            w.finish(r)
        assert w.drained()


def test_replay_moves_what_the_shared_layer_reads(monkeypatch):
    """Without the replay, the shared layers' rows would be stale: the check
    must see it (the test can fail)."""
    roles = LayerRoles.from_pattern("FSSS")
    w = World(roles, prefetch=True, monkeypatch=monkeypatch, exactness=True)
    reqs = [w.staged("long", 300), w.staged("other", 500)]
    w.coord.collect_ready_reqs()
    w.coord.prefetch.skip_io = True  # replays launched no more (the anchor still copies)
    for step in range(3):
        w.decode(reqs, _top_k_drawer(step))
    assert w.coord.get_hisparse_stats()["exact_mismatches"] > 0
    for r in reqs:
        w.finish(r)
    assert w.drained()


def test_replays_launch_the_grid_the_environment_names(monkeypatch):
    """SGLANG_HISPARSE_PREFETCH_GRID reaches every replay's launch; a bad
    value is refused naming the variable and what it takes."""
    from sglang_hisparse.engine import prefetch as prefetch_mod
    from sglang_hisparse.engine.prefetch import ReplayGrid

    assert ReplayGrid.from_environ({}) == ReplayGrid(16, 512)
    assert ReplayGrid.from_environ({PREFETCH_GRID_ENV: "smx32"}) == ReplayGrid(None, 32)
    assert ReplayGrid.from_environ({PREFETCH_GRID_ENV: "8x512"}) == ReplayGrid(8, 512)
    for spelling in ("smx512", "smx32", "264x32"):
        assert str(ReplayGrid.parse(spelling)) == spelling
    for bad in ("0x512", "8x64", "8", "lots", "2000x32", "x32"):
        assert env_problems({PREFETCH_GRID_ENV: bad}) == [
            f"{PREFETCH_GRID_ENV}={bad!r} is not valid; allowed: BLOCKSxTHREADS, BLOCKS an integer "
            f"from 1 to 1024 or sm (one per SM), THREADS 512 or 32 (e.g. 16x512, the default, "
            f"or smx512)"]
    monkeypatch.setenv(PREFETCH_GRID_ENV, "12x32")
    w = World(LayerRoles.from_pattern("FSSS"), prefetch=True, monkeypatch=monkeypatch)
    grids = []
    real_replay = prefetch_mod.IndexSharePrefetch.replay_followers

    def spy(self, anchor, requests, num_real_reqs, pools, layout, copy):
        def counted(**kw):
            grids.append((kw["num_blocks"], kw["threads"]))
            return copy(**kw)
        return real_replay(self, anchor, requests, num_real_reqs, pools, layout, counted)

    monkeypatch.setattr(prefetch_mod.IndexSharePrefetch, "replay_followers", spy)
    reqs = [w.staged("long", 300)]
    w.coord.collect_ready_reqs()
    w.decode(reqs, _top_k_drawer(0))
    assert grids == [(12, 32)] * 3
    for r in reqs:
        w.finish(r)
    assert w.drained()


def test_prefetch_priority_switch_reaches_the_stream(monkeypatch):
    """The prefetch stream runs above the forward's default priority (0)
    unless SGLANG_HISPARSE_PREFETCH_PRIORITY=0; anything but 0 and 1 is
    refused naming the variable."""
    assert env_problems({PREFETCH_PRIORITY_ENV: "high"}) == [
        f"{PREFETCH_PRIORITY_ENV}='high' is not valid; allowed: 0, 1"]
    for value, want in ((None, -1), ("0", 0), ("1", -1)):
        if value is None:
            monkeypatch.delenv(PREFETCH_PRIORITY_ENV, raising=False)
        else:
            monkeypatch.setenv(PREFETCH_PRIORITY_ENV, value)
        w = World(LayerRoles.from_pattern("FSSS"), prefetch=True, monkeypatch=monkeypatch)
        assert w.coord.streams.prefetch_priority == want
        assert w.coord.prefetch.streams is w.coord.streams


def test_parked_request_joins_in_lockstep(monkeypatch):
    """Parking (the real policy): a request parks while a prompt waits for
    rows, then joins from host with an empty hot buffer in every layer at
    once; prefetch and synchronous still agree byte for byte."""
    from sglang_hisparse.engine.policies.parking import PrefillDemand
    from sglang_hisparse.engine.state import ReqState

    roles = LayerRoles.from_pattern("FSFS")
    worlds = [World(roles, prefetch=p, monkeypatch=monkeypatch, exactness=True, parking=True)
              for p in (True, False)]
    reqs = []
    for w in worlds:
        demand = [PrefillDemand(0, 1900, 1, 8)]  # a prompt waits for most rows
        w.coord.set_prefill_demand(lambda d=demand: d[0])
        r = w.staged("long", 700)
        assert w.coord.collect_ready_reqs() == []
        assert w.coord.state_of(r) is ReqState.PARKED
        demand[0] = PrefillDemand(0, 0, 0, 8)  # the prompt got its rows elsewhere
        assert w.coord.collect_ready_reqs() == [r]
        reqs.append([r])
    for step in range(4):
        outs = [w.decode(rs, _top_k_drawer(step)) for w, rs in zip(worlds, reqs)]
        for layer in range(LAYERS):
            assert torch.equal(outs[0][layer], outs[1][layer])
            assert torch.equal(worlds[0].pool.kv_buffer[layer], worlds[1].pool.kv_buffer[layer])
    assert worlds[0].coord.get_hisparse_stats()["exact_mismatches"] == 0
    for w, rs in zip(worlds, reqs):
        w.finish(rs[0])
        assert w.drained()


def test_verify_rows_with_the_prefetch(monkeypatch):
    """MTP verify steps (n rows per request, one union swap-in per layer, a
    shared layer handed the anchor's rows): with the prefetch every layer
    reads exactly what it selected (the verify tests' tag check and the
    in-server check), and the outputs, device pools and counters equal the
    synchronous coordinator's."""
    import random

    from dataplane_fixtures import speculative_server_args
    from test_coordinator import Env
    from test_verify_step import N, verify_step

    roles = LayerRoles.from_pattern("FS")  # the verify tests' pools hold two layers
    envs, committed, reqs = [], [], []
    for prefetch in (True, False):
        with monkeypatch.context() as m:
            m.setenv(INDEXSHARE_PREFETCH_ENV, "1" if prefetch else "0")
            env = Env(phys=2048, draft_tokens=N, exactness_check=True, index_roles=roles)
        assert (env.coord.prefetch is not None) == prefetch
        reqs.append([env.staged("long", 300), env.staged("short", 40)])
        env.coord.collect_ready_reqs()
        envs.append(env)
        committed.append([300, 40])
    for step in range(12):
        accept = [(step + b) % N + 1 for b in range(2)]
        committed = [verify_step(env, rs, c, random.Random(step), accept)
                     for env, rs, c in zip(envs, reqs, committed)]
        for layer in range(len(roles.roles)):
            assert torch.equal(envs[0].pool.kv_buffer[layer], envs[1].pool.kv_buffer[layer])
    fetched, sync = (e.coord for e in envs)
    assert fetched.prefetch.replays == 12 * sum(roles.is_shared)
    got, want = fetched.get_hisparse_stats(), sync.get_hisparse_stats()
    assert got["exact_checked"] == want["exact_checked"] > 0
    assert got["exact_mismatches"] == 0 and got["misses"] == want["misses"] > 0
    with speculative_server_args():
        for env, rs in zip(envs, reqs):
            for r in rs:
                env.finish(r)
            assert env.drained()
