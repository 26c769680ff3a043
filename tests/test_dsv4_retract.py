"""PD decode retraction of a DeepSeek-V4 request on CPU: its C4 rows stay on
host, and its device-resident state (C4 indexer keys and C128 KV by logical
page, SWA KV and compressor states by SWA page) comes back into the pages it
resumes with.

The pools are the release's ``DeepSeekV4TokenToKVPool(enable_hisparse=True)``
(compress ratios [0, 4, 128, 4], page 256 for the full and the SWA pages, as
0.5.13's model runner builds them) with our C4 pool, SGLang's SWA allocator
inside our C4 allocator, our coordinator and C4 host pool. Retraction runs
0.5.13's own ``release_req``; resumption the patched ``_pre_alloc`` and
``Req.load_kv_cache``, as in ``tests/test_disaggregation.py``. Every test
counts full, SWA, C4, host and request slots back to the start.
"""

from array import array

import pytest
import torch

from dataplane_fixtures import (
    drained,
    chunk_cache, decode_node_server_args, decode_step, dsv4_pool, kv_allocated_len, make_req,
    our_c4_pool_as_native, pre_alloc, release, req_pool,
)
from sglang_hisparse.engine.policies.retain_on_retract import RetainedHostKV
from sglang_hisparse.kernels import reference

PS = 256  # full and SWA page (0.5.13's mixin asserts the SWA page is 256)
FULL, SWA, C4_DEV = 8192, 4096, 1024
HOT, TOPK = 128, 16  # in C4 tokens
STATE_ROWS = SWA // PS * 128  # ring rows per SWA page (or request slot), the C128 ring the largest
RATIOS = [0, 4, 128, 4]
WINDOW = 128  # DeepSeek-V4's sliding window


@pytest.fixture
def server_args():
    with decode_node_server_args(PS) as args:
        yield args


def c4_tag(tokens, layer):
    """A C4 row naming its compressed token and layer (value and scale parts)."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    data = torch.zeros(tokens.numel(), reference.C4_ITEM_BYTES, dtype=torch.uint8)
    data[:, 0], data[:, 1], data[:, 2] = tokens % 256, tokens // 256, layer + 1
    return data


def c4_tokens(buf, rows):
    got = reference.read_rows(buf, torch.as_tensor(rows), layout="c4")
    return (got[:, 0].long() + 256 * got[:, 1].long()).tolist()


class V4PDEnv:
    def __init__(self):
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

        from sglang_hisparse.adapter.model_runner import HiSparseCoordinator
        from sglang_hisparse.pools.allocator_c4 import DSV4HiSparseAllocator

        with our_c4_pool_as_native():
            self.pool = dsv4_pool(compression_ratios=RATIOS, swa_size=SWA,
                                  c4_size=C4_DEV, c128_size=FULL // 128,
                                  state_pool_size=STATE_ROWS, page_size=PS, enable_hisparse=True)
        swa = SWATokenToKVPoolAllocator(FULL, SWA, page_size=PS, dtype=torch.uint8, device="cpu",
                                        kvcache=self.pool, need_sort=False)
        self.alloc = DSV4HiSparseAllocator(swa)
        self.r2t = req_pool(8, 4096)
        self.coord = HiSparseCoordinator(self.r2t, self.alloc, TOPK, HOT, "cpu", None, 2)
        assert self.coord.retain.enabled  # a PD decode node (the fixture's server args)
        self.host = self.coord.mem_pool_host
        self.cache = chunk_cache(self.r2t, self.alloc)
        self.start = self.counts()

    # -------------------------------------------------------------- the pools
    def by_logical_page(self):
        p = self.pool
        return (list(p.c4_indexer_kv_pool.index_k_with_scale_buffer)
                + list(p.c128_kv_pool.kv_buffer))

    def _states(self):
        """(state, kept per request slot) of every compressor state: the C128
        attention state is per request from 0.5.15 (the pool clears it by
        slot), per SWA page before, as every other state."""
        p = self.pool
        per_request = hasattr(p, "clear_c128_req_state")
        out = []
        for layer, ratio in enumerate(RATIOS):
            attention, indexer = p.compress_state_pools[layer], p.indexer_compress_state_pools[layer]
            if attention is not None:
                out.append((attention, per_request and ratio == 128))
            if indexer is not None:
                out.append((indexer, False))
        assert len(out) == 5  # attention: two C4 layers, one C128; indexer: the C4 layers
        return out

    def by_swa_page(self):
        """(buffer, rows per SWA page) of the SWA KV and the states kept by SWA page."""
        return ([(b, 0) for b in self.pool.swa_kv_pool.kv_buffer]
                + [(s.kv_score_buffer.kv_score, s.ring_size) for s, slot in self._states() if not slot])

    def by_slot(self):
        """(buffer, rows per request slot) of the states kept per request."""
        return [(s.kv_score_buffer.kv_score, s.ring_size) for s, slot in self._states() if slot]

    @staticmethod
    def _rows(page, ring):
        return [page] if ring == 0 else list(range(page * ring, (page + 1) * ring))

    def logical_pages(self, req, n):
        full = self.r2t.req_to_token[req.req_pool_idx, :n].long()
        return {pos: int(full[pos]) // PS for pos in range(0, n, PS)}

    def swa_pages(self, req, n):
        """Position -> SWA page of every position that holds an SWA slot."""
        full = self.r2t.req_to_token[req.req_pool_idx, :n].long()
        swa = self.alloc.translate_loc_from_full_to_swa(full)
        return {pos: int(swa[pos]) // PS for pos in range(n) if int(swa[pos]) > 0}

    @staticmethod
    def value(j, pos):
        """What buffer ``j`` holds for the page of position ``pos`` (its page's
        first position, so every position of a page names the same value)."""
        return (j * 37 + (pos // PS) * 11 + 5) % 250 + 1

    def write_device_state(self, req, n):
        """What the forward leaves for positions [0, n): each page a value
        naming its buffer and the request's page."""
        for j, buf in enumerate(self.by_logical_page()):
            for pos, page in self.logical_pages(req, n).items():
                buf[page] = self.value(j, pos)
        for j, (buf, ring) in enumerate(self.by_swa_page()):
            for pos, page in self.swa_pages(req, n).items():
                buf[self._rows(page, ring)] = self.value(100 + j, pos)
        for j, (buf, ring) in enumerate(self.by_slot()):
            buf[self._rows(req.req_pool_idx, ring)] = self.value(200 + j, 0)

    def device_state_matches(self, req, positions, n):
        ok = all(bool((buf[page] == self.value(j, pos)).all())
                 for j, buf in enumerate(self.by_logical_page())
                 for pos, page in self.logical_pages(req, n).items())
        pages = self.swa_pages(req, n)
        ok = ok and all(
            bool((buf[self._rows(pages[pos], ring)] == self.value(100 + j, pos)).all())
            for j, (buf, ring) in enumerate(self.by_swa_page()) for pos in positions)
        return ok and all(
            bool((buf[self._rows(req.req_pool_idx, ring)] == self.value(200 + j, 0)).all())
            for j, (buf, ring) in enumerate(self.by_slot()))

    def scrub_device_state(self):
        """Every device-resident byte overwritten: only a restore brings it back."""
        for buf in self.by_logical_page():
            buf.fill_(0xEE)
        for buf, _ in self.by_swa_page() + self.by_slot():
            buf.fill_(-7)

    # ------------------------------------------------------------ lifecycle
    def counts(self):
        swa = self.alloc.logical_attn_allocator
        return dict(full=swa.full_available_size(), swa=swa.swa_available_size(),
                    c4=self.alloc.physical_available_size(), host=self.host.available_size(),
                    req=self.r2t.available_size())

    def admit(self, rid, n):
        """A request whose C4 KV the prefill wrote into host rows and whose
        device tail and window landed at its own pages."""
        req = make_req(rid, n)
        host = pre_alloc(self.r2t, self.alloc, self.coord, req)
        assert host.numel() == n // 4
        for layer in range(2):
            reference.write_rows(self.host.kv_buffer[layer], host,
                                 c4_tag(torch.arange(n // 4), layer), "c4")
        self.write_device_state(req, n)
        self.coord.admit_request_direct(req)
        return req

    def decode(self, req):
        """One decode step; the forward writes the C4 row a step closes and the
        new token's device state."""
        _, seq, out = decode_step(self.r2t, self.alloc, self.coord, [req])
        n = int(seq[0])
        if n % 4 == 0:
            rows = self.pool.c4_kv_pool.translate_loc_from_full_to_hisparse_device(out)
            for layer in range(2):
                reference.write_rows(self.pool.c4_kv_pool.kv_buffer[layer], rows,
                                     c4_tag([n // 4 - 1], layer), "c4")
        self.write_device_state(req, n)

    def retract(self, req, server_args):
        from sglang.srt.managers.schedule_batch import release_req

        release_req(req=req, remaing_req_count=0, server_args=server_args,
                    req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                    tree_cache=self.cache, hisparse_coordinator=self.coord)

    def finish(self, req):
        self.coord.request_finished(req)
        release(self.r2t, self.alloc, req)

    def drained(self):
        return drained(self)


@pytest.mark.parametrize("prompt,steps", [(700, 5), (300, 8), (1030, 0)])
def test_a_retracted_v4_request_resumes_with_its_device_state(server_args, prompt, steps):
    env = V4PDEnv()
    req = env.admit("v4", prompt)
    for _ in range(steps):
        env.decode(req)
    req.output_ids = array("q", [7] * (steps + 1))
    need = prompt + steps  # SGLang's snapshot length: seqlen - 1
    window = range(max(0, need - WINDOW), need)
    old_logical, old_slot = env.logical_pages(req, need), req.req_pool_idx
    assert env.device_state_matches(req, window, need)

    env.retract(req, server_args)

    kept = req.kv_cache_cpu
    assert isinstance(kept, RetainedHostKV) and kept.num_tokens == need
    logical, swa, *per_slot = kept.device_state
    assert len(per_slot) == (1 if env.by_slot() else 0)  # 0.5.15 on: the C128 state by slot
    assert logical.keys.tolist() == list(range(0, need, PS))
    assert set(window) <= {p for k in swa.keys.tolist() for p in range(k, k + PS)}
    # the C4 rows are on host, the newest closed group included
    for layer in range(2):
        assert c4_tokens(env.host.kv_buffer[layer], kept.rows[: need // 4]) == \
            list(range(need // 4))
    now = env.counts()
    assert {k: now[k] for k in ("full", "swa", "c4", "req")} == \
        {k: env.start[k] for k in ("full", "swa", "c4", "req")}, (now, env.start)
    assert now["host"] == env.start["host"] - kept.rows.numel()

    # another request takes the freed pages; every device byte is scrubbed
    other = env.admit("other", 600)
    env.scrub_device_state()
    pre_alloc(env.r2t, env.alloc, env.coord, req)  # resume_retracted_reqs: new slots
    assert env.logical_pages(req, need) != old_logical and req.req_pool_idx != old_slot
    assert not env.device_state_matches(req, window, need)

    req.load_kv_cache(env.r2t, env.alloc)

    assert not hasattr(req, "kv_cache_cpu") and kept.rows is None and kept.device_state == ()
    assert env.device_state_matches(req, window, need)
    idx = req.req_pool_idx
    for layer in range(2):
        assert c4_tokens(env.host.kv_buffer[layer], env.coord.req_to_host_pool[idx, : need // 4]) \
            == list(range(need // 4))
    for _ in range(4):  # decoding goes on, write-through from the restored rows
        env.decode(req)
    n = kv_allocated_len(req)
    for layer in range(2):
        assert c4_tokens(env.host.kv_buffer[layer],
                         env.coord.req_to_host_pool[idx, : (n - 1) // 4 - 1]) == \
            list(range((n - 1) // 4 - 1))
    env.finish(req)
    env.finish(other)
    assert env.drained()


def test_an_abort_while_retracted_returns_every_slot(server_args):
    env = V4PDEnv()
    req = env.admit("v4", 700)
    env.decode(req)
    req.output_ids = array("q", [7, 7])
    env.retract(req, server_args)
    kept = req.kv_cache_cpu
    assert kept.holds_rows and kept.device_state
    env.coord.release_retained(kept)
    assert kept.rows is None and kept.device_state == ()
    assert env.drained()


def test_the_request_slot_rows_are_the_rows_sglang_clears_for_a_slot():
    """From 0.5.15 the C128 attention state is the request slot's:
    ``RequestSlotRows`` must name exactly the rows the release's own
    ``clear_c128_req_state`` resets for that slot (0.5.13: no such state)."""
    from sglang_hisparse.engine.retained_device_state import dsv4_device_state

    with our_c4_pool_as_native():
        pool = dsv4_pool(compression_ratios=RATIOS, swa_size=SWA, c4_size=C4_DEV,
                         c128_size=FULL // 128, state_pool_size=STATE_ROWS, page_size=PS,
                         enable_hisparse=True)
    state = dsv4_device_state(pool, lambda ids: ids)
    by_slot = [g for g in state.groups if g.__class__.__name__ == "RequestSlotRows"]
    if not hasattr(pool, "clear_c128_req_state"):
        assert by_slot == []
        pytest.skip("this release keeps every compressor state by SWA page")
    (group,) = by_slot
    (buf,) = group.buffers
    buf.fill_(5.0)
    pool.clear_c128_req_state(3)
    changed = torch.nonzero((buf != 5.0).any(dim=-1)).flatten()
    (rows,) = group.rows(torch.zeros(0, dtype=torch.int64), group.keys(None), 3)
    assert changed.tolist() == rows.tolist()
