#!/usr/bin/env python
"""Seeded random HiSparse lifecycle with the real SGLang 0.5.13 pools.

    python scripts/soak.py --steps 1000 --seed 0                 # CPU
    TRITON_INTERPRET=0 python scripts/soak.py --device cuda ...  # GPU

Builds SGLang's ``ReqToTokenPool`` and ``DSATokenToKVPool`` on the device
plus our allocator / host pool / coordinator, then plays a scheduler: arrivals
with prompt lengths from a few tokens to several hot buffers, (chunked)
prefill, finish right after prefill, staging (copies kept "in flight" for a
few polls), decode steps with random top-k, finish, abort in every state
(waiting, staging, running), retract on memory pressure and at random.
With parking on (the default) the coordinator sees the simulated queue
through a prefill-demand provider, so staged requests also wait on host
(parked) and join later with a fresh hot buffer.

``--mode pd`` plays a PD decode node instead: each arrival's prompt KV is
written straight into host rows (as the transfer engine does after
``_pre_alloc``) and admitted with ``admit_request_direct``; retraction keeps
the KV on host (``get_cpu_copy``) and the request resumes from it later
(``load_cpu_copy``), or is aborted while retracted.

Every prefill/decode token gets a KV row whose bytes name (request, token,
layer); every swap-in output row is checked against those bytes, and the
swap-in's hot-slot/LRU update is checked step by step against an independent
pure-Python LRU model. At the end everything is drained and one line states
free-after-drain vs free-at-start for every allocator and the host pool.
Exit status is non-zero on a leak or any mismatch.

The scheduler's side is SGLang's own code wherever it can run outside a
server: each decode step is ``ScheduleBatch.prepare_for_decode`` on a real
batch (``alloc_for_decode``, then the coordinator's ``map_last_loc_to_buffer``),
a request is released by ``release_kv_cache`` through a ``ChunkCache`` and
retracted by ``release_req``, a PD node pre-allocates with
``DecodePreallocQueue._pre_alloc`` and resumes with ``Req.load_kv_cache``,
and an abort of a retracted request goes through ``Scheduler.abort_request``
inside our hook (the queue and the scheduler as namespaces holding what those
functions read; see ``tests/dataplane_fixtures.py``).

Each decode step runs in the order of a server with the overlap scheduler:
the batch is prepared on the scheduler's stream (write-through of the
previous token included), then the forward runs on its own stream, which is
the coordinator's decode producer stream (``set_decode_producer_stream``, as
0.5.13's ``Scheduler`` sets it): ``wait_for_pending_backup`` and
``num_real_reqs.fill_`` as ``ModelRunner.forward`` does, then the new tokens'
KV is written, then the per-layer swap-ins run. Releases after the step
wait for that stream (the coordinator's job).

On CPU the swap-in is the torch reference and staging copies finish after a
random number of polls; with ``--device cuda`` everything the coordinator
does runs as in a server (our JIT swap-in kernel, SGLang's Triton allocator
kernels, staging and write-through on their own streams, the forward on a
producer stream, pinned host memory) and the same checks read the device
back.

``--speculative N`` plays MTP/EAGLE with N draft tokens instead of plain
decode: each step reserves the next positions through 0.5.13's own
``EagleDraftInputV2Mixin.prepare_for_decode`` inside our hook (logical slots
only), maps the verify slots (``engine/verify.py``), writes the N verified
tokens' KV, swaps in N rows per request as one union (every row checked
against the tags, the verified positions included), commits, and accepts
1..N tokens at random; a running request is also finished or aborted
between the mapping and the commit, and retracted. The LRU model check is
the decode path's (the union's LRU is held to the reference by
``tests/test_kernel_reference.py``). With residency on, residents verify in
their own rows (the reserve's pages mapped by ``Residency.cover_reserve``)
and are demoted mid-run by admission or by growth short of rows.

``--verbose`` prints one JSON line of counters before the verdict line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
from array import array
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # dataplane_fixtures: SGLang's scheduler-side calls

from sglang_hisparse.adapter import releases  # noqa: E402
from sglang_hisparse.engine.state import ReqState  # noqa: E402


def _swap_in_for(device: str):
    """(swap-in function for the coordinator, its name): the torch reference
    on CPU, the coordinator's own default (our JIT kernel) on CUDA."""
    if device == "cpu":
        from sglang_hisparse.kernels.reference import swap_in

        return swap_in, "sglang_hisparse.kernels.reference"
    return None, "sglang_hisparse.kernels.swap_in (JIT)"


class Mismatch(AssertionError):
    pass


def _kv_tag(uid: int, tok: int, layer: int):
    # Integers below 256 are exact in bf16.
    return (tok % 251, uid % 251, layer + 1, (tok // 251) % 251)


def _put_tags(layer_buffers, uid: int, positions, rows) -> None:
    """Write each position's tag into its row, every layer."""
    positions, rows = list(positions), list(rows)
    if not positions:
        return
    for layer, buf in enumerate(layer_buffers):
        tags = [_kv_tag(uid, p, layer) for p in positions]
        buf[torch.tensor(rows, dtype=torch.int64, device=buf.device), 0, :4] = torch.tensor(
            tags, dtype=buf.dtype, device=buf.device)


class LruModel:
    """Independent model of one (layer, request) hot buffer."""

    def __init__(self, hot: int):
        self.hot = hot
        self.slot_token = [-1] * hot
        self.order = list(range(hot))  # least recent first

    def reset_resident(self, n: int):
        self.slot_token = [i if i < n else -1 for i in range(self.hot)]
        self.order = list(range(self.hot))

    def step(self, selected, newest):
        """Return (hit_slots, evicted_slots(set), stale_order, misses)."""
        where = {t: s for s, t in enumerate(self.slot_token) if t >= 0}
        hits = {where[t] for t in selected if t != newest and t in where}
        misses = [t for t in selected if t != newest and t not in where]
        evictable = [s for s in self.order if s not in hits]
        evicted = evictable[: len(misses)]
        return hits, set(evicted), evictable[len(misses):], misses


class Sim:
    def __init__(self, seed: int, page_size: int = 64, phys_pages: int = 30, ratio: int = 3,
                 hot: int = 128, top_k: int = 16, layers: int = 2, max_reqs: int = 12,
                 max_ctx: int = 1400, residency: bool = True, parking: bool = True,
                 pd: bool = False, device: str = "cpu", draft_tokens: int = 1):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_hisparse.pools.allocator import HiSparseDualAllocator
        from sglang_hisparse.pools.device_dsa import HiSparseDSADevicePool
        from sglang_hisparse.adapter.model_runner import HiSparseCoordinator

        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.ps, self.hot, self.top_k, self.layers = page_size, hot, top_k, layers
        self.max_ctx = max_ctx
        self.device = device
        phys = phys_pages * page_size
        # The server's device pool: latent rows for the physical space, the
        # indexer's keys for the logical one (a PD retraction saves them by
        # logical page).
        self.pool = HiSparseDSADevicePool(
            phys, page_size=page_size, kv_lora_rank=512, dtype=torch.bfloat16,
            qk_rope_head_dim=64, layer_num=layers, device=device, index_head_dim=128,
            enable_memory_saver=False, kv_cache_dim=576, host_to_device_ratio=ratio,
        )
        self.r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_ctx, device=device,
                                  enable_memory_saver=False)
        self.alloc = HiSparseDualAllocator(phys, page_size, torch.bfloat16, device, self.pool,
                                           False, host_to_device_ratio=ratio)
        self.ref, self.ref_name = _swap_in_for(device)
        from sglang_hisparse.pools.host import HiSparseMLAHostPool

        # Host smaller than the logical space, so admission is host-bound at times.
        per_token = 576 * 2 * layers
        host = HiSparseMLAHostPool(self.pool, host_size=(phys * 2.5 * per_token) / 1e9,
                                   page_size=page_size)
        self.coord = HiSparseCoordinator(self.r2t, self.alloc, top_k, hot, device, None, ratio,
                                         host_pool=host, swap_in_fn=self.ref,
                                         residency=residency, pd_decode=pd,
                                         draft_tokens=draft_tokens,
                                         # Its scheduler runs no streaming hook:
                                         # parking keeps its prefill-ahead here.
                                         streaming="0")
        self.draft_tokens = draft_tokens
        self.pd = pd
        from sglang.srt.server_args import ServerArgs

        from dataplane_fixtures import chunk_cache, prealloc_queue

        # What SGLang's functions read (release_kv_cache, release_req, ...).
        self.server_args = ServerArgs(model_path="dummy")
        self.server_args.page_size = page_size
        self.server_args.disaggregation_mode = "decode" if pd else "null"
        if draft_tokens > 1:  # what release_kv_cache and the EAGLE reserve read
            self.server_args.speculative_algorithm = "EAGLE"
            self.server_args.speculative_num_steps = draft_tokens - 1
            self.server_args.speculative_eagle_topk = 1
            self.server_args.speculative_num_draft_tokens = draft_tokens
        self.cache = chunk_cache(self.r2t, self.alloc)
        self.prealloc = prealloc_queue(self.r2t, self.alloc, self.coord, self.server_args)
        # The forward runs on its own stream, the coordinator's decode
        # producer stream (0.5.13 Scheduler: set_decode_producer_stream(forward_stream)).
        self.forward_stream = None
        if str(device).startswith("cuda"):
            self.forward_stream = torch.cuda.Stream()
            self.coord.set_decode_producer_stream(self.forward_stream)
        self.in_forward = False
        self.coord.set_cpu_staging_delay(lambda: self.rng.choice([0, 0, 1, 3]))
        self.max_reqs = max_reqs
        if parking and not pd:  # a PD decode node prefills nothing
            self.coord.set_prefill_demand(self.prefill_demand)
        self.host = self.coord.mem_pool_host
        self.start = self.snapshot()
        self.uid = 0
        self.waiting, self.prefilling, self.staging, self.running = [], [], [], []
        self.retracted = []  # PD: requests whose KV waits on host (Req.kv_cache_cpu)
        self.models = {}  # req -> [LruModel per layer]
        self.stats = dict(prefill=0, finish_prefill=0, staged=0, decode_steps=0, finish=0,
                          abort_waiting=0, abort_staging=0, abort_running=0, abort_prefill=0,
                          retract=0, retract_oom=0, swap_checks=0, host_wait_max=0,
                          resident_checks=0, parked=0, transferred=0, resumed=0,
                          abort_retracted=0, verify_steps=0, accepted=0, abort_in_verify=0,
                          resident_verify=0)
        self.was_resident = set()  # requests seen resident (reset their model on demotion)

    # ---------------------------------------------------------- bookkeeping
    def snapshot(self):
        return dict(
            logical=self.alloc.logical_available_size(),
            physical=self.alloc.physical_available_size(),
            host=self.host.available_size(),
            req_slots=self.r2t.available_size(),
        )

    def new_req(self):
        self.uid += 1
        r = self.rng.random()
        if r < 0.35:
            n = self.rng.randint(2, self.hot - 1)
        elif r < 0.5:
            n = self.rng.choice([self.hot - 1, self.hot, self.hot + 1, self.ps, self.ps + 1])
        else:
            n = self.rng.randint(self.hot + 1, 4 * self.hot)
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(f"r{self.uid}.", "", array("q", [1] * n),
                  SamplingParams(max_new_tokens=self.rng.randint(1, 3 * self.hot)))
        req.sim_uid = self.uid
        req.sim_len = 0  # tokens whose KV exists
        req.sim_target = n
        req.sim_decode_left = req.sampling_params.max_new_tokens
        self.waiting.append(req)

    def write_kv(self, req, positions, logical):
        if self.in_forward and self.forward_stream is not None \
                and torch.cuda.current_stream() != self.forward_stream:
            raise Mismatch(f"{req.rid}: decode KV written outside the producer stream")
        phys = self.alloc.translate_to_physical(logical)
        if bool((phys <= 0).any()):
            raise Mismatch(f"{req.rid}: write to an unmapped logical slot")
        _put_tags(self.pool.kv_buffer, req.sim_uid, positions, phys.tolist())

    def release_slots(self, req):
        """0.5.13 ``release_kv_cache`` (ChunkCache: the request's KV slots and
        its request slot)."""
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache)
        self.forget(req)

    def forget(self, req):
        self.models.pop(req, None)
        self.was_resident.discard(req)

    def release_req(self, req):
        """0.5.13 ``release_req`` (what ``retract_decode`` runs per request):
        the coordinator's retract_req, on a PD decode node the KV snapshot
        (``get_cpu_copy``), ``release_kv_cache``, ``reset_for_retract``."""
        from sglang.srt.managers.schedule_batch import release_req

        release_req(req=req, remaing_req_count=0, server_args=self.server_args,
                    req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                    tree_cache=self.cache, hisparse_coordinator=self.coord)
        self.forget(req)

    def dev(self, values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=self.device)

    def lens(self, v):
        """A length as SGLang passes it: (device tensor, CPU tensor)."""
        return self.dev([v]), torch.tensor([v], dtype=torch.int64)

    def page_up(self, n):
        return -(-n // self.ps) * self.ps

    def prefill_demand(self):
        """What try_prefill will ask for, in the coordinator's terms."""
        from sglang_hisparse.engine.policies.parking import PrefillDemand

        in_flight = sum(self.page_up(r.sim_target) - self.page_up(r.sim_len)
                        for r in self.prefilling)
        nxt = 0
        if self.waiting and self.r2t.available_size():
            nxt = self.page_up(self.waiting[0].sim_target) + self.ps
        return PrefillDemand(in_flight, nxt, len(self.running), self.max_reqs)

    # ------------------------------------------------------------- actions
    def try_prefill(self):
        if not self.waiting or not self.r2t.available_size():
            return
        req = self.waiting[0]
        need = self.page_up(req.sim_target) + self.ps
        # chunks still to come for requests already prefilling
        need += sum(self.page_up(r.sim_target) - self.page_up(r.sim_len) for r in self.prefilling)
        if self.alloc.available_size() < need:
            return
        self.waiting.pop(0)
        (idx,) = self.r2t.alloc([req])
        req.req_pool_idx = idx
        releases.current.set_kv_allocated_len(req, 0)
        self.prefilling.append(req)

    def prefill_chunk(self, req):
        pre, end = req.sim_len, min(req.sim_target, req.sim_len + self.rng.choice([64, 96, 10**6]))
        last = (self.r2t.req_to_token[req.req_pool_idx, pre - 1:pre].to(torch.int64)
                if pre else self.dev([-1]))
        out = self.alloc.alloc_extend(*self.lens(pre), *self.lens(end), last, end - pre)
        if out is None:
            raise Mismatch("alloc_extend failed after admission said yes")
        self.r2t.req_to_token[req.req_pool_idx, pre:end] = out.to(torch.int32)
        self.write_kv(req, range(pre, end), out)
        releases.current.set_prefill_range(req, pre, end)
        req.sim_len = req.kv_committed_len = end
        releases.current.set_kv_allocated_len(req, end)
        self.stats["prefill"] += 1
        if end < req.sim_target:
            return
        self.prefilling.remove(req)
        if self.rng.random() < 0.08:  # finished right after prefill
            self.coord.request_finished(req)  # coordinator never saw it: no-op
            self.release_slots(req)
            self.stats["finish_prefill"] += 1
            return
        self.coord.admit_request_into_staging(req)
        self.staging.append(req)
        self.stats["staged"] += 1

    def collect(self):
        parked = set(self.coord.parked_requests())
        for req in self.coord.collect_ready_reqs():
            self.staging.remove(req)
            self.running.append(req)
            models = [LruModel(self.hot) for _ in range(self.layers)]
            # Slot i holds token i, except a long parked request's fresh
            # buffer, which starts empty.
            start = 0 if req in parked and req.sim_len > self.hot else min(req.sim_len, self.hot)
            for m in models:
                m.reset_resident(start)
            self.models[req] = models
        self.stats["parked"] += len(set(self.coord.parked_requests()) - parked)
        self.stats["host_wait_max"] = max(self.stats["host_wait_max"], self.coord.requests.count(ReqState.HOST_WAIT))

    def fit(self, batch, need):
        """Retract at random until the pool can serve ``need(batch)`` rows
        (like ScheduleBatch.check_decode_mem); what is left of the batch."""
        while batch and self.alloc.available_size() < need(batch):
            victim = batch.pop(self.rng.randrange(len(batch)))
            self.retract(victim)
            self.stats["retract_oom"] += 1
        return batch

    def reserve_speculative(self, batch):
        """0.5.13's EagleDraftInputV2Mixin.prepare_for_decode inside our hook:
        the next 2 x n positions of each request, logical slots only."""
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.eagle_info_v2 import EagleDraftInputV2Mixin

        from dataplane_fixtures import decode_batch
        from sglang_hisparse.adapter.speculative import eagle_prepare_for_decode

        step = decode_batch(self.r2t, self.alloc, self.coord, batch, self.device)
        eagle_prepare_for_decode(EagleDraftInputV2Mixin.prepare_for_decode, EagleDraftInput(), step)

    def reserve_need(self, batch):
        # get_alloc_reserve_per_decode: 2 x max(steps x top-k, draft tokens) past the committed + 1
        return sum(self.page_up(r.sim_len + 1 + 2 * self.draft_tokens)
                   - self.page_up(releases.current.kv_allocated_len(r)) for r in batch)

    def verify(self):
        """One speculative step (see the module docstring)."""
        from dataplane_fixtures import verify_locs

        n = self.draft_tokens
        batch = self.fit([r for r in self.running if r.sim_len + 2 * n + 1 < self.max_ctx],
                         self.reserve_need)
        if not batch:
            return
        self.reserve_speculative(batch)
        rpi = [r.req_pool_idx for r in batch]
        committed = [r.sim_len for r in batch]
        locs = verify_locs(self.r2t, batch, committed, n)
        self.coord.verify.map_slots(rpi, [releases.current.kv_allocated_len(r) for r in batch], self.dev(committed),
                                    locs.to(self.device))
        # (after map_slots: it may have demoted some)
        self.stats["resident_verify"] += sum(map(self.coord.residency.holds, rpi))
        with self.forward():
            self.coord.wait_for_pending_backup()
            self.coord.num_real_reqs.fill_(len(batch))
            for r, s, loc in zip(batch, committed, locs):
                self.write_kv(r, range(s, s + n), loc)
            self.check_verify_swap_in(batch, rpi, committed)
        self.coord.verify.commit()
        self.stats["verify_steps"] += 1
        for r in list(batch):
            kept = self.rng.randint(1, n)  # accept_length + 1
            r.sim_len += kept
            r.kv_committed_len = r.sim_len
            self.stats["accepted"] += kept
            r.sim_decode_left -= kept
            if r.sim_decode_left <= 0:
                self.finish(r)

    def check_verify_swap_in(self, batch, rpi, committed):
        n, bs = self.draft_tokens, len(batch)
        topk = torch.full((bs * n, self.top_k), -1, dtype=torch.int32)
        for i, (r, s) in enumerate(zip(batch, committed)):
            for j in range(n):
                sel = self.rng.sample(range(s + j + 1), min(self.top_k - 1, s + j + 1))
                sel = [t for t in sel if t != s + j][: self.top_k - 1] + [s + j]
                topk[i * n + j, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
        topk = topk.to(self.device)
        seq_rows = self.dev([s + j + 1 for s in committed for j in range(n)])
        for layer in range(self.layers):
            out = self.coord.swap_in_selected_pages(self.dev(rpi), seq_rows, topk, layer)
            buf = self.pool.kv_buffer[layer]
            out_rows, top_rows = out.tolist(), topk.tolist()
            for row in range(bs * n):
                r = batch[row // n]
                sel = [t for t in top_rows[row] if t >= 0]
                rows = out_rows[row][: len(sel)]
                if any(x <= 0 for x in rows):
                    raise Mismatch(f"{r.rid} layer {layer}: unmapped row in verify row {row}")
                held = buf[self.dev(rows), 0, :4].tolist()
                for t, got in zip(sel, held):
                    if tuple(int(x) for x in got) != _kv_tag(r.sim_uid, t, layer):
                        raise Mismatch(f"{r.rid} layer {layer} token {t}: verify read {got}")
            self.stats["swap_checks"] += 1

    def abort_in_verify(self):
        """Finish or abort a running request between map_slots and commit."""
        from dataplane_fixtures import verify_locs

        if not self.running:
            return
        req = self.running[self.rng.randrange(len(self.running))]
        n, s = self.draft_tokens, req.sim_len
        if s + 2 * n + 1 >= self.max_ctx or self.alloc.available_size() < self.reserve_need([req]):
            return
        self.reserve_speculative([req])
        locs = verify_locs(self.r2t, [req], [s], n)
        self.coord.verify.map_slots([req.req_pool_idx], [releases.current.kv_allocated_len(req)], self.dev([s]),
                                    locs.to(self.device))
        self.running.remove(req)
        self.coord.request_finished(req)
        self.release_slots(req)
        self.stats["abort_in_verify"] += 1

    def decode(self):
        if self.draft_tokens > 1:
            return self.verify()
        batch = [r for r in self.running if r.sim_len + 1 < self.max_ctx]
        if not batch:
            return
        batch = self.fit(batch, lambda b: sum(1 for r in b if r.sim_len % self.ps == 0) * self.ps)
        if not batch:
            return
        # The scheduler's stream: 0.5.13's own prepare_for_decode (new slots,
        # then map_last_loc_to_buffer: write-through of the previous tokens).
        from dataplane_fixtures import decode_batch

        step = decode_batch(self.r2t, self.alloc, self.coord, batch, self.device)
        step.prepare_for_decode()
        rpi, seq, out = step.req_pool_indices, step.seq_lens, step.out_cache_loc
        with self.forward():
            # ModelRunner.forward: wait for the write-through, count the real
            # rows; then the model writes the new tokens' KV and each layer
            # swaps in its selection.
            self.coord.wait_for_pending_backup()
            self.coord.num_real_reqs.fill_(len(batch))
            for r, loc in zip(batch, out):
                self.write_kv(r, [r.sim_len], loc.view(1))
                r.sim_len += 1
            self.check_swap_in(batch, rpi, seq)
        self.stats["decode_steps"] += 1
        for r in list(batch):
            r.sim_decode_left -= 1
            if r.sim_decode_left <= 0:
                self.finish(r)

    @contextlib.contextmanager
    def forward(self):
        """The forward pass: on CUDA on the producer stream, after the
        scheduler's stream (0.5.13 run_batch: forward_stream.wait_stream)."""
        self.in_forward = True
        try:
            if self.forward_stream is None:
                yield
            else:
                self.forward_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.forward_stream):
                    yield
        finally:
            self.in_forward = False

    def check_swap_in(self, batch, rpi, seq):
        bs = len(batch)
        pad = self.rng.choice([0, 0, 1])  # CUDA-graph style padded rows
        topk = torch.full((bs + pad, self.top_k), -1, dtype=torch.int32)  # filled on CPU
        for i, r in enumerate(batch):
            n = min(r.sim_len, self.top_k - self.rng.randint(0, 2))
            pool = list(range(r.sim_len))
            if r.sim_len > self.hot and self.rng.random() < 0.6:
                # temporal locality: favour recently selected / recent tokens
                pool = list(range(max(0, r.sim_len - 3 * self.hot), r.sim_len))
            sel = self.rng.sample(pool, min(n, len(pool)))
            topk[i, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
        topk = topk.to(self.device)
        rpi_p = torch.cat([rpi, self.dev([0] * pad)])
        seq_p = torch.cat([seq, self.dev([1] * pad)])
        for layer in range(self.layers):
            before_lru = self.coord.lru_slots[layer].clone()
            out = self.coord.swap_in_selected_pages(rpi_p, seq_p, topk, layer)
            if pad and bool((out[bs:] != -1).any()):
                raise Mismatch("padded row not -1")
            buf = self.pool.kv_buffer[layer]
            out_rows, top_rows = out.tolist(), topk.tolist()
            for i, r in enumerate(batch):
                idx, s = r.req_pool_idx, r.sim_len
                sel = [t for t in top_rows[i] if t >= 0]
                rows = out_rows[i][: len(sel)]
                if any(x != -1 for x in out_rows[i][len(sel):]):
                    raise Mismatch(f"{r.rid}: output beyond selection not -1")
                if any(row <= 0 for row in rows):
                    raise Mismatch(f"{r.rid} layer {layer}: unmapped row in {rows}")
                held = buf[self.dev(rows), 0, :4].tolist() if rows else []
                for t, row, got in zip(sel, rows, held):
                    if tuple(int(x) for x in got) != _kv_tag(r.sim_uid, t, layer):
                        raise Mismatch(f"{r.rid} layer {layer} token {t}: row {row} holds {got}")
                self.check_lru(r, layer, sel, s, before_lru[idx])
            self.stats["swap_checks"] += 1

    def check_lru(self, r, layer, sel, s, lru_before):
        m = self.models[r][layer]
        idx = r.req_pool_idx
        tokens = self.coord.req_device_buffer_tokens[layer, idx, : self.hot].tolist()
        lru = self.coord.lru_slots[layer, idx].tolist()
        if self.coord.residency.holds(idx):
            if lru != lru_before.tolist():
                raise Mismatch(f"{r.rid}: a resident request's LRU changed")
            self.was_resident.add(r)
            self.stats["resident_checks"] += 1
            return
        if r in self.was_resident:
            # Demoted since: its hot buffer starts over like a staged request's.
            for mm in self.models[r]:
                mm.reset_resident(self.hot)
            self.was_resident.discard(r)
        if s <= self.hot:
            if lru != lru_before.tolist():
                raise Mismatch(f"{r.rid}: fast path changed the LRU")
            m.reset_resident(min(s, self.hot))  # short: slot i holds token i
            return
        hits, evicted, stale, misses = m.step(sel, s - 1)
        nh, nm = len(hits), len(misses)
        if lru[: len(stale)] != stale:
            raise Mismatch(f"{r.rid} L{layer}: stale order {lru[:len(stale)]} != model {stale}")
        if set(lru[len(stale): len(stale) + nm]) != evicted:
            raise Mismatch(f"{r.rid} L{layer}: miss slots differ from model")
        if set(lru[len(lru) - nh:] if nh else []) != hits:
            raise Mismatch(f"{r.rid} L{layer}: hit slots not most recent")
        if {tokens[x] for x in evicted} != set(misses):
            raise Mismatch(f"{r.rid} L{layer}: evicted slots do not hold the misses")
        for x in range(self.hot):
            if x not in evicted and tokens[x] != m.slot_token[x]:
                raise Mismatch(f"{r.rid} L{layer}: slot {x} changed without a miss")
        m.slot_token, m.order = tokens, lru

    def finish(self, req):
        self.running.remove(req)
        self.coord.request_finished(req)
        self.release_slots(req)
        self.stats["finish"] += 1

    def retract(self, req):
        if self.pd:
            return self.pd_retract(req)
        self.running.remove(req)
        self.release_req(req)
        req.sim_len = 0
        req.sim_target = len(req.origin_input_ids)
        self.waiting.append(req)
        self.stats["retract"] += 1

    def abort_random(self):
        states = [s for s in ("waiting", "prefilling", "staging", "running", "retracted")
                  if getattr(self, s)]
        if not states:
            return
        # staging lasts a few polls only: pick it whenever it is possible
        state = "staging" if "staging" in states else self.rng.choice(states)
        q = getattr(self, state)
        req = q[self.rng.randrange(len(q))]
        q.remove(req)
        if state == "waiting":
            self.stats["abort_waiting"] += 1
            return
        if state == "retracted":
            # 0.5.13 abort_request (drops the snapshot) inside our hook (frees
            # its host rows first), on the prealloc queue's retracted list.
            from dataplane_fixtures import abort, abort_scheduler

            q.append(req)
            sched, sent = abort_scheduler(self.coord, self.r2t, self.alloc, decode=True,
                                          retracted=q)
            abort(sched, req.rid)
            self.retracted = sched.disagg_decode_prealloc_queue.retracted_queue
            if hasattr(req, "kv_cache_cpu") or [o.rid for o in sent] != [req.rid] \
                    or req in self.retracted:
                raise Mismatch(f"{req.rid}: abort while retracted not carried out")
            self.stats["abort_retracted"] += 1
            return
        if state == "staging":
            self.coord.abort_staging_request(req)
            self.stats["abort_staging"] += 1
        elif state == "running":
            self.coord.request_finished(req)
            self.stats["abort_running"] += 1
        else:
            self.coord.request_finished(req)
            self.stats["abort_prefill"] += 1
        self.release_slots(req)

    # ------------------------------------------------------ PD decode node
    def pre_alloc(self, req):
        """``DecodePreallocQueue._pre_alloc`` as patched (its HiSparse branch: a
        request slot, logical slots, host rows) behind a budget check; the
        host rows, or None when the budget says no."""
        from dataplane_fixtures import pre_alloc

        n = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
        if not self.r2t.available_size() or self.alloc.available_size() < self.page_up(n) + self.ps:
            return None
        return pre_alloc(self.r2t, self.alloc, self.coord, req, self.prealloc)

    def join(self, req):
        """Decoding from host: a short request is loaded whole, a long one starts empty."""
        self.running.append(req)
        models = [LruModel(self.hot) for _ in range(self.layers)]
        for m in models:
            m.reset_resident(req.sim_len if req.sim_len <= self.hot else 0)
        self.models[req] = models

    def try_transfer(self):
        rows = self.pre_alloc(self.waiting[0]) if self.waiting else None
        if rows is None:
            return
        req = self.waiting.pop(0)
        # the prefill node's KV lands on host
        _put_tags(self.host.kv_buffer, req.sim_uid, range(req.sim_target), rows.tolist())
        req.sim_len = req.sim_target
        self.coord.admit_request_direct(req)
        self.join(req)
        self.stats["transferred"] += 1

    def pd_retract(self, req):
        """0.5.13 ``release_req`` on a decode node: retract_req, then the
        snapshot of seqlen - 1 tokens (every token whose KV exists here)."""
        self.running.remove(req)
        req.output_ids = array("q", [1] * (req.sim_len + 1 - len(req.origin_input_ids)))
        self.release_req(req)
        self.retracted.append(req)
        self.stats["retract"] += 1

    def try_resume(self):
        """0.5.13 ``resume_retracted_reqs``: ``_pre_alloc``, then ``load_kv_cache``."""
        if not self.retracted or self.pre_alloc(self.retracted[0]) is None:
            return
        req = self.retracted.pop(0)
        req.load_kv_cache(self.r2t, self.alloc)
        self.join(req)
        self.stats["resumed"] += 1

    # ---------------------------------------------------------------- run
    def step(self):
        with self.sglang():
            self._step()

    @contextlib.contextmanager
    def sglang(self):
        """The soak's ServerArgs as SGLang's process-wide ones while SGLang's
        functions run (restored after: tests run the soak in-process)."""
        from dataplane_fixtures import installed_server_args

        with installed_server_args(self.server_args):
            yield

    def _step(self):
        rng = self.rng
        if rng.random() < 0.35 and len(self.waiting) < 8:
            self.new_req()
        if self.pd:
            self.try_resume()
            self.try_transfer()
        else:
            self.try_prefill()
            for req in list(self.prefilling):
                self.prefill_chunk(req)
            self.collect()
        self.decode()
        if rng.random() < 0.04:
            self.abort_random()
        if self.draft_tokens > 1 and rng.random() < 0.03:
            self.abort_in_verify()
        if rng.random() < 0.02 and self.running:
            self.retract(self.running[rng.randrange(len(self.running))])

    def drain(self):
        with self.sglang():
            self._drain()

    def _drain(self):
        for req in list(self.staging) + list(self.running) + list(self.prefilling):
            if req in self.staging:
                self.staging.remove(req)
                self.coord.abort_staging_request(req)
            elif req in self.running:
                self.running.remove(req)
                self.coord.request_finished(req)
            else:
                self.prefilling.remove(req)
            self.release_slots(req)
        for req in self.retracted:
            self.coord.release_retained(req.kv_cache_cpu)
        self.waiting.clear()
        self.retracted.clear()
        self.coord.destroy()

    def leak_report(self):
        end = self.snapshot()
        mapped = int((self.alloc.full_to_hisparse_device_index_mapping[:-1] != 0).sum())
        extra = dict(coordinator_live=len(self.coord.live_request_slots()),
                     mapping_nonzero=mapped, prefill_claims=self.alloc.pending_prefill_claim(),
                     host_rows_nonneg=int((self.coord.req_to_host_pool >= 0).sum()))
        ok = end == self.start and not any(extra.values())
        parts = [f"{k} free {end[k]}/{self.start[k]}" for k in ("logical", "physical", "host", "req_slots")]
        parts += [f"{k}={v}" for k, v in extra.items()]
        return ok, parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--residency", choices=("on", "off"), default="on",
                    help="resident requests until rows run short (the default) or stage all")
    ap.add_argument("--parking", choices=("on", "off"), default="on",
                    help="staged requests may wait on host while prompts need the rows")
    ap.add_argument("--mode", choices=("colocated", "pd"), default="colocated",
                    help="pd: a PD decode node (prompt KV arrives on host; retraction keeps it)")
    ap.add_argument("--device", default="cpu",
                    help="cpu (torch reference swap-in) or cuda (the JIT kernel, real streams)")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--hot", type=int, default=128, help="hot buffer size B")
    ap.add_argument("--speculative", type=int, default=1, metavar="N",
                    help="MTP/EAGLE verify steps of N draft tokens instead of decode (N >= 2)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.speculative > 1 and args.mode == "pd":
        ap.error("--speculative: PD decode with MTP is not supported yet")
    # What a server would refuse (e.g. a hot buffer smaller than the verify
    # rows' draft tokens x top-k) is refused here too, by the same rules.
    from sglang_hisparse.config import HiSparseConfig, HiSparseConfigError

    try:
        HiSparseConfig(top_k=args.top_k, device_buffer_size=args.hot).resolve(
            args.top_k, args.speculative)
    except HiSparseConfigError as exc:
        ap.error(f"--hot/--top-k/--speculative: {exc}")
    sim = Sim(args.seed, residency=args.residency == "on", parking=args.parking == "on",
              pd=args.mode == "pd", device=args.device, top_k=args.top_k, hot=args.hot,
              draft_tokens=args.speculative)
    error = None
    try:
        for _ in range(args.steps):
            sim.step()
        sim.drain()
    except Mismatch as exc:
        error = f"MISMATCH: {exc}"
    ok, parts = sim.leak_report()
    if args.verbose:
        print(json.dumps({"swap_in": sim.ref_name, "stats": sim.stats,
                          "coordinator": sim.coord.get_hisparse_stats(),
                          "producer_stream": sim.coord.decode_producer_stream is not None}))
    verdict = "OK" if ok and error is None else "FAIL"
    spec = f" speculative={args.speculative}" if args.speculative > 1 else ""
    print(f"soak seed={args.seed} steps={args.steps} mode={args.mode} device={args.device} "
          f"residency={args.residency} parking={args.parking}{spec} {verdict}: "
          + ", ".join(parts)
          + (f"; {error}" if error else ""))
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
