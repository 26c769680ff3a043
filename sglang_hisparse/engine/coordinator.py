"""The HiSparse coordinator: drives each request through its states.

A request past prefill is admitted (``admit_request_into_staging``) and
from then on has one :class:`~sglang_hisparse.engine.state.ReqState`; the
diagram and the legal moves are in :mod:`sglang_hisparse.engine.state`.
This class owns the mechanics every state shares: the device tables
(:mod:`.tables`), the host rows, the copies and their stream order
(:mod:`.streams`), hot buffers, write-through and the per-layer swap-in.
The decisions that differ by deployment are policies over that state, each
in its own module under :mod:`.policies`:

* :class:`~.policies.residency.Residency` - keep a request's whole KV on the
  GPU while rows allow, demote the largest residents when they run short;
* :class:`~.policies.parking.Parking` - a staged request waits on host while
  its hot buffer would take rows a waiting prompt needs;
* :class:`~.policies.retain_on_retract.RetainOnRetract` - on a PD decode node
  a retracted request keeps its KV on host and resumes from it;
* :class:`~.policies.streaming.Streaming` - a request that has streamed a
  token does not wait for other prompts' prefill (the scheduler's prefill
  batches interleave with decode steps, capped; new prompts wait for parked
  requests).

Per decode step: ``map_last_loc_to_buffer`` writes the previous token of
every hot-buffer request through to host, grows short hot buffers and maps
the new token to its slot; the attention backend then calls
``swap_in_selected_pages`` per layer, which runs the fused swap-in kernel
(and, with ``SGLANG_HISPARSE_CHECK=1``, the exactness check after it).

The SGLang-facing side (the 0.5.13 constructor, server args, metrics, the
host pool class) is :class:`sglang_hisparse.adapter.model_runner.HiSparseCoordinator`;
nothing here imports SGLang. The 0.5.13 call sites this class serves are
hash-pinned as DEPENDS entries of :mod:`sglang_hisparse.manifest`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional

import torch

from sglang_hisparse.config import (
    CHECK_ENV,
    INDEXSHARE_PREFETCH_ENV,
    PARKING_ENV,
    PREFETCH_PRIORITY_ENV,
    RESIDENCY_ENV,
    SKIP_IO_ENV,
    STREAMING_ENV,
    SYNTHETIC_TOPK_ENV,
)
from sglang_hisparse.engine.exactness import ExactnessCheck
from sglang_hisparse.engine.index_share import LayerRoles, prefetch_off_reason
from sglang_hisparse.engine.policies.parking import Parking
from sglang_hisparse.engine.prefetch import IndexSharePrefetch, ReplayGrid
from sglang_hisparse.engine.policies.residency import Residency
from sglang_hisparse.engine.policies.retain_on_retract import RetainOnRetract
from sglang_hisparse.engine.policies import streaming as streaming_policy
from sglang_hisparse.engine.state import ReqState, RequestTable
from sglang_hisparse.engine.streams import (RealRequestCount, Streams, TrailingReader,
                                            device_index, fill_at)
from sglang_hisparse.engine.tables import RequestTables
from sglang_hisparse.engine.verify import VerifyStep
from sglang_hisparse.kernels import synthetic_top_k

logger = logging.getLogger(__name__)

S = ReqState
_RESIDENT, _RESIDENT_JOINING, _PARKED = S.RESIDENT, S.RESIDENT_JOINING, S.PARKED
_STAGING, _HOST_WAIT, _HOT = S.STAGING, S.HOST_WAIT, S.HOT
_TRANSFERRING = S.TRANSFERRING
# Past prefill, not in the running batch: what staged_requests lists and
# has_ongoing_staging asks about (an abort must still reach these).
_NOT_IN_BATCH = (S.STAGING, S.HOST_WAIT, S.RESIDENT_JOINING, S.HOT_JOINING, S.PARKED)


class HiSparseTokenStats(NamedTuple):
    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


@dataclass
class _Staging:
    event: object
    req: object


class AccountingDrift(RuntimeError):
    """Admission let in work the pools cannot serve (a bug in the budget)."""


def _swap_in_kernel():
    from sglang_hisparse import kernels

    return kernels.swap_in_selected


def _copy_planned_kernel():
    from sglang_hisparse.kernels.copy_planned import copy_planned_selected

    return copy_planned_selected


class Coordinator:
    """Per-request hot buffers, host backing and swap-in (see module docstring)."""

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        top_k: int,
        device_buffer_size: int,
        device,
        tp_group,
        host_to_device_ratio: int = 2,
        *,
        host_pool,
        swap_in_fn: Optional[Callable] = None,
        swap_in_block_size: Optional[int] = None,
        residency: Optional[bool] = None,
        parking: Optional[bool] = None,
        streaming: Optional[str] = None,
        pd_decode: bool = False,
        pd_growth_clip: Optional[int] = None,
        exactness_check: Optional[bool] = None,
        draft_tokens: int = 1,
        index_roles: Optional[LayerRoles] = None,
        pp_size: int = 1,
    ):
        if device_buffer_size < top_k:
            raise ValueError(
                f"device_buffer_size ({device_buffer_size}) must be >= top_k ({top_k})")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = alloc = token_to_kv_pool_allocator
        self.top_k = top_k
        self.device_buffer_size = device_buffer_size
        self.device = device
        self.host_to_device_ratio = host_to_device_ratio
        self.compress_ratio = getattr(alloc, "compress_ratio", 1)
        self.is_dsv4_hisparse = self.compress_ratio != 1
        self._swap_in_fn = swap_in_fn
        self.swap_in_block_size = swap_in_block_size
        # Timing probe: the swap-in resolves and publishes slots but skips its
        # host->device copies (outputs wrong; ours vs ours-without-IO shows
        # what the copies cost).
        self.skip_io = os.environ.get(SKIP_IO_ENV) == "1"
        if self.skip_io:
            logger.warning("%s=1: swap-in host copies are skipped; outputs are invalid "
                           "(for timing only)", SKIP_IO_ENV)
        # Benchmark-only: a top-k trace of known step-to-step locality in
        # place of the indexer's (random weights have almost none); outputs
        # invalid, timings valid.
        self.synthetic_trace = synthetic_top_k.from_env()
        if self.synthetic_trace is not None:
            logger.warning("%s: the indexer's top-k is replaced by the synthetic trace %s; "
                           "outputs are invalid (for timing only)", SYNTHETIC_TOPK_ENV,
                           self.synthetic_trace)

        if self.is_dsv4_hisparse:
            self.mem_pool_device = alloc.hisparse_kvcache  # the C4 physical pool
            self.item_size_bytes = (self.mem_pool_device.kv_cache_total_dim
                                    * self.mem_pool_device.store_dtype.itemsize)
        else:
            self.mem_pool_device = alloc.get_kvcache()
            self.item_size_bytes = host_pool.item_bytes
        self.mem_pool_host = host_pool
        self.page_size = self.mem_pool_device.page_size
        self.layer_num = self.mem_pool_device.layer_num
        # Extra page: its first slot holds the newest token of a long request.
        self.padded_buffer_size = device_buffer_size + self.page_size

        max_reqs = req_to_token_pool.req_to_token.shape[0]
        max_host_ctx = -(-req_to_token_pool.max_context_len // self.compress_ratio)
        # Speculative verify (MTP/EAGLE): rows per request of each swap-in.
        self.draft_tokens = int(draft_tokens)
        self.tables = t = RequestTables(
            max_reqs=max_reqs, max_host_ctx=max_host_ctx, layers=self.layer_num,
            top_k=top_k, buffer_size=device_buffer_size, page_size=self.page_size,
            device=device, rows_per_req=self.draft_tokens)
        # 0.5.13's attribute names (SGLang, tests and scripts read them).
        self.req_to_device_buffer = t.req_to_device_buffer
        self.req_device_buffer_size = t.req_device_buffer_size
        self.req_to_host_pool = t.req_to_host_pool
        self.req_to_host_pool_allocated_len = t.req_to_host_pool_allocated_len
        self.req_device_buffer_tokens = t.slot_tokens
        self.req_device_buffer_token_locs = t.slot_locs
        self.lru_slots = t.lru
        self.top_k_device_locs_buffer = t.top_k_out
        self._synthetic_top_k = (torch.empty_like(t.top_k_out)
                                 if self.synthetic_trace is not None else None)
        self.raw_indices_buffer = t.raw_indices
        self.req_resident = t.resident
        self.num_real_reqs = RealRequestCount(device)

        self.requests = RequestTable()
        self.ack_staging_queue: List[_Staging] = []  # STAGING, in copy order
        # The prefetch above the forward's priority unless told "0" (the
        # A/B of 2026-12-05: engine/prefetch.py's ReplayGrid has the figures).
        self.streams = Streams(device, prefetch_high_priority=os.environ.get(
            PREFETCH_PRIORITY_ENV, "1") != "0")
        self.write_staging_stream = self.streams.staging
        self.decode_backup_stream = self.streams.backup

        self.tp_group = tp_group
        self.tp_world_size = 1
        if tp_group is not None and torch.distributed.is_initialized():
            self.tp_world_size = torch.distributed.get_world_size(group=tp_group)

        # Counters (decode log line, Prometheus). The kernel's tally of
        # (selected tokens, misses) stays on the device: no sync on decode;
        # its rows are set up with the IndexShare prefetch below.
        self.host_bytes_written = 0
        self.host_bytes_read_staging = 0  # preloads (PD admission, parked joins)
        self.host_wait_events = 0
        self.demotions = 0
        # Join waits: from a request's prefill end (its first token) to the
        # collect that puts it in the running batch (staging copy, host
        # pages, parking). Its first inter-token gap is this plus a decode
        # step, so the decode log shows what HiSparse adds to it.
        self.clock: Callable[[], float] = time.monotonic
        self.joins = 0
        self.join_wait_s = 0.0
        self.join_wait_max_s = 0.0
        # Free counts of every pool at the first idle check (see idle_leaks).
        self._idle_baseline: Optional[dict] = None
        self.accounting_drifts = 0
        # Called with (req, message) when admission accounting drifted and a
        # request cannot be served; the adapter aborts it with that reason.
        self.on_drift: Optional[Callable[[object, str], None]] = None

        self.verify = VerifyStep(self, self.draft_tokens) if self.draft_tokens > 1 else None
        if residency is None:
            residency = os.environ.get(RESIDENCY_ENV, "1") != "0"
        if parking is None:
            parking = os.environ.get(PARKING_ENV, "1") != "0"
        # C4 rows are compressed per page of tokens: residency and parking
        # are implemented for DSA rows only.
        self.residency = Residency(self, enabled=bool(residency) and not self.is_dsv4_hisparse)
        self.parking = Parking(self, enabled=bool(parking) and not self.is_dsv4_hisparse)
        self.retain = RetainOnRetract(self, enabled=bool(pd_decode))
        # ``streaming``: the switch's value ("0", "hold", "1", a token cap);
        # None: the environment's. A PD decode node prefills nothing.
        if streaming is None:
            streaming = os.environ.get(STREAMING_ENV)
        mode = streaming_policy.OFF if pd_decode else streaming_policy.parse(streaming, STREAMING_ENV)
        self.streaming = streaming_policy.Streaming(mode)
        self.pd_decode = bool(pd_decode)
        # PD decode admission holds back, in host rows, the tokens every
        # request on the node may still decode (max_new_tokens, clipped as
        # SGLang clips its own estimate): retraction keeps KV on host, so it
        # cannot give host rows back to the running requests.
        self.pd_growth_clip = pd_growth_clip

        if exactness_check is None:
            exactness_check = os.environ.get(CHECK_ENV) == "1"
        self.exactness = ExactnessCheck(self) if exactness_check else None

        # IndexShare (engine/index_share.py, engine/prefetch.py): the model's
        # layer roles, and the prefetch when it runs.
        if index_roles is not None and index_roles.num_layers != self.layer_num:
            raise ValueError(f"index_roles name {index_roles.num_layers} layers, the KV pool "
                             f"holds {self.layer_num}")
        self.index_roles = index_roles
        off = prefetch_off_reason(index_roles, is_deepseek_v4=self.is_dsv4_hisparse,
                                  pp_size=pp_size, environ=os.environ)
        self.prefetch = None
        if off is None:
            self.prefetch = IndexSharePrefetch(
                index_roles, max_requests=max_reqs, plan_width=self.draft_tokens * top_k,
                device=device, streams=self.streams, skip_io=self.skip_io,
                grid=ReplayGrid.from_environ(os.environ))
            # (once at start-up, at WARNING so that every server log shows it)
            logger.warning("HiSparse IndexShare prefetch on (%s=0 turns it off): %s; replay grid %s, "
                           "stream priority %d", INDEXSHARE_PREFETCH_ENV, index_roles,
                           self.prefetch.grid, self.streams.prefetch_priority)
        elif index_roles is not None and index_roles.shares:
            logger.warning("HiSparse IndexShare prefetch off: %s", off)
        # Tally row w - 1 counts the swap-ins that stand for w layers: an
        # anchor whose shared layers follow its plan moves (and misses) the
        # same rows once per layer, so the counters match a synchronous run.
        stands_for = (self.prefetch.layers_per_swap_in if self.prefetch is not None
                      else (1,) * self.layer_num)
        self._tally = torch.zeros((max(stands_for), 2), dtype=torch.int64, device=device)
        self._tally_of_layer = tuple(self._tally[w - 1] for w in stands_for)
        self._tally_reader = TrailingReader(self._tally)

        if hasattr(alloc, "set_reservation_provider"):
            alloc.set_reservation_provider(self._owed_tokens)
            alloc.attach_host_pool(self.mem_pool_host, self.padded_buffer_size)
            if self.residency.enabled:
                alloc.set_residency(self.residency.reclaimable_rows, self.residency.reclaim_rows)
            if self.retain.enabled:
                alloc.set_retraction(self.retain.take_retained, self.retain.restore_retained)
                alloc.set_host_reserve(self.pd_host_reserve)

    # ------------------------------------------------------------ helpers
    def _page_up(self, n: int) -> int:
        return -(-int(n) // self.page_size) * self.page_size

    @staticmethod
    def prefill_len(req) -> int:
        """How far the request's prefill reached (its KV length once the
        prefill ran). SGLang names this differently per release (0.5.13:
        ``fill_len``); the adapter's coordinator reads it the installed
        release's way."""
        return req.fill_len

    @staticmethod
    def kv_allocated_len(req) -> int:
        """How many KV slots the request holds (allocated, committed or not:
        a speculative reserve runs ahead). 0.5.17 moved it into ``req.kv``;
        the adapter's coordinator reads it the installed release's way."""
        return req.kv_allocated_len

    def host_token_len(self, kv_allocated_len: int) -> int:
        return kv_allocated_len // self.compress_ratio if self.is_dsv4_hisparse else kv_allocated_len

    def _mapping(self) -> torch.Tensor:
        alloc = self.token_to_kv_pool_allocator
        m = getattr(alloc, "full_to_hisparse_device_index_mapping", None)
        return m if m is not None else self.mem_pool_device.full_to_hisparse_device_index_mapping

    def _logical_ids(self, idx: int, n: int) -> torch.Tensor:
        """The first ``n`` tokens' ids in the mapping's space (compressed for V4)."""
        logical = self.req_to_token_pool.req_to_token[idx, :n].to(torch.int64)
        if self.is_dsv4_hisparse:
            logical = self.mem_pool_device.translate_loc_from_full_to_compressed(logical)
        return logical

    def note_drift(self, req, what: str) -> str:
        """Count and log a place where admission let in work the pools cannot
        serve (a budget bug); the caller keeps the request safe."""
        self.accounting_drifts += 1
        msg = f"HiSparse: request {req.rid}: {what} (admission accounting drifted)"
        logger.error(msg)
        return msg

    def _drift(self, req, what: str) -> None:
        """Drift that leaves a running request unservable: stop that request
        (the adapter aborts it with the message as its finish reason) and
        keep the server running, where 0.5.13 would crash or corrupt KV."""
        msg = self.note_drift(req, what)
        if self.on_drift is None:
            raise AccountingDrift(msg)
        self.on_drift(req, msg)

    def _owed_tokens(self):
        """(physical, host) tokens live requests may still claim; see
        :mod:`sglang_hisparse.engine.budget`. The scheduler asks several times
        a step: one loop, state read once."""
        phys = host = 0
        P = self.padded_buffer_size
        page_up, host_tokens, allocated = self._page_up, self.host_token_len, self.kv_allocated_len
        buffer_size, host_len = self.tables.buffer_size_np, self.tables.host_len_np
        # States as locals: an enum member read is an attribute lookup a time.
        resident, joining, parked = _RESIDENT, _RESIDENT_JOINING, _PARKED
        staging, host_wait, transferring = _STAGING, _HOST_WAIT, _TRANSFERRING
        for idx, rec in self.requests.records():
            state = rec.state
            if state is resident or state is joining:
                held = rec.resident_rows
            elif state is parked or state is transferring:
                # Claims rows only when it joins (checked then); SGLang's PD
                # prealloc budget already counts a hot buffer per transfer.
                held = P
            elif state is staging or state is host_wait:
                # Rows it still holds from prefill, in this pool's units (C4 rows for V4).
                held = page_up(host_tokens(self.prefill_len(rec.req)))
            else:
                held = int(buffer_size[idx])
            if held < P:
                phys += P - held
            need = page_up(host_tokens(allocated(rec.req))) - int(host_len[idx])
            if need > 0:
                host += need
        return phys, host

    def pd_host_reserve(self) -> int:
        """Host rows the PD decode token budget holds back
        (``logical_attn_allocator.available_size()``, what the prealloc and
        the resumption of retracted requests admit against): for every
        request holding host rows on the node, live or retracted, the rows it
        may still fill: its prompt plus max_new_tokens (clipped by
        ``pd_growth_clip``), less the rows it holds; at least the rows its
        allocated tokens still need. A retracted request's kept rows count as
        free there (SGLang's budget takes each retracted request's whole
        length off again), less what it may still fill. Negative: a credit."""
        clip = self.pd_growth_clip
        page_up, host_tokens = self._page_up, self.host_token_len
        host_len = self.tables.host_len_np
        reserve = 0
        for idx, rec in self.requests.records():
            req = rec.req
            held = int(host_len[idx])
            need = page_up(host_tokens(self.kv_allocated_len(req))) - held
            grow = page_up(host_tokens(self._final_len(req, clip))) - held
            reserve += max(need, grow, 0)
        for kept in self.retain.kept():
            held = kept.rows.numel()
            grow = page_up(host_tokens(self._final_len(kept.req, clip))) - held
            reserve += max(grow, 0) - held
        return reserve

    @staticmethod
    def _final_len(req, clip: Optional[int]) -> int:
        """The longest the request may grow: prompt + max_new_tokens (clipped)."""
        new = req.sampling_params.max_new_tokens
        if new is None:
            new = clip or 0
        elif clip is not None:
            new = min(new, clip)
        return len(req.origin_input_ids) + int(new)

    def _buffer_size_for(self, num_tokens: int) -> int:
        size = min(self._page_up(num_tokens), self.device_buffer_size)
        return self.padded_buffer_size if size == self.device_buffer_size else size

    def set_decode_producer_stream(self, stream) -> None:
        self.streams.decode_producer = stream

    @property
    def decode_producer_stream(self):
        return self.streams.decode_producer

    def set_cpu_staging_delay(self, fn: Callable[[], int]) -> None:
        """Tests: number of polls a CPU staging copy stays "in flight"."""
        self.streams.cpu_event_delay = fn

    # ------------------------------------------------------ policy entries
    # (the allocator and SGLang's scheduler reach the policies through these)
    def reclaimable_rows(self) -> int:
        return self.residency.reclaimable_rows()

    def reclaim_rows(self, need: int) -> int:
        return self.residency.reclaim_rows(need)

    def set_prefill_demand(self, provider) -> None:
        self.parking.set_prefill_demand(provider)

    @property
    def prefill_demand_installed(self) -> bool:
        return self.parking.installed

    @property
    def prefill_demand_provider(self):
        """The installed view of the scheduler (None: none, or parking off)."""
        return self.parking.provider

    def prefill_pending(self) -> bool:
        return self.parking.prefill_pending()

    def parked_requests(self) -> List[object]:
        return self.requests.in_state(S.PARKED)

    def take_retained(self, num_tokens: int):
        return self.retain.take_retained(num_tokens)

    def restore_retained(self, kept, token_indices) -> None:
        self.retain.restore_retained(kept, token_indices)

    def release_retained(self, kept) -> None:
        self.retain.release_retained(kept)

    # ------------------------------------------------------- idle leak check
    def pool_free_counts(self) -> dict:
        """Free rows / slots of every pool a request takes from, by name."""
        alloc = self.token_to_kv_pool_allocator
        logical = alloc.logical_attn_allocator
        counts = {"device rows": alloc.physical_available_size(),
                  "host rows": self.mem_pool_host.available_size(),
                  "request slots": self.req_to_token_pool.available_size()}
        if self.is_dsv4_hisparse:  # the logical allocator is SGLang's SWA one: full and SWA ids
            counts["full tokens"] = logical.full_available_size()
            counts["swa tokens"] = logical.swa_available_size()
        else:
            counts["logical tokens"] = alloc.logical_available_size()
        return counts

    def holds_anything(self) -> bool:
        """A request, a copy in flight or a retracted request's host rows."""
        return bool(len(self.requests) or self.ack_staging_queue or len(self.retain.kept()))

    def idle_leaks(self) -> List[str]:
        """With the scheduler fully idle: each pool whose free count differs
        from the first idle check's, as "name: free now (then)". SGLang skips
        its own idle leak check under HiSparse (0.5.13 to 0.5.17
        ``Scheduler.on_idle``); this one takes its place. The first check
        with nothing held sets the baseline (the pools after start-up, CUDA
        graph capture and the warm-up request); a check while the
        coordinator still holds something (a retracted request's host rows
        on a PD decode node) compares nothing."""
        if self.holds_anything():
            return []
        now = self.pool_free_counts()
        if self._idle_baseline is None:
            self._idle_baseline = now
            return []
        return [f"{name}: {now[name]} free ({then} at the first idle check)"
                for name, then in self._idle_baseline.items() if now.get(name) != then]

    # -------------------------------------------------------------- stats
    def get_token_stats(self) -> HiSparseTokenStats:
        dev = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        dev_cap = dev.size
        raw = getattr(dev, "raw_available_size", dev.available_size)()
        dev_used = dev_cap - raw
        host_cap = self.mem_pool_host.size
        host_used = host_cap - self.mem_pool_host.available_size()
        return HiSparseTokenStats(
            dev_used, dev_used / dev_cap if dev_cap else 0.0,
            host_used, host_used / host_cap if host_cap else 0.0,
        )

    def get_hisparse_stats(self) -> dict:
        """Counters for the decode log line / Prometheus (no device sync; the
        kernel's counts trail by one reading on a GPU)."""
        active = self.requests.slots_in(S.HOT)
        cap = int(self.req_device_buffer_size[active].sum()) if active else 0
        counts = self._tally_reader.read()  # [selected, misses] per row, flat
        selected = sum(w * c for w, c in enumerate(counts[0::2], start=1))
        misses = sum(w * c for w, c in enumerate(counts[1::2], start=1))
        stats = {
            "hits": selected - misses,
            "misses": misses,
            "host_bytes_read": misses * self.item_size_bytes + self.host_bytes_read_staging,
            "host_bytes_written": self.host_bytes_written,
            "hot_buffer_tokens": cap,
            "hot_buffer_occupancy": cap / (len(active) * self.padded_buffer_size) if active else 0.0,
            "active_reqs": len(active),
            "staging_reqs": self.requests.count(S.STAGING),
            "host_wait_reqs": self.requests.count(S.HOST_WAIT),
            "host_wait_events": self.host_wait_events,
            "joins": self.joins,
            "join_wait_s": self.join_wait_s,
            "join_wait_max_s": self.join_wait_max_s,
            "resident_reqs": self.requests.count(S.RESIDENT) + self.requests.count(S.RESIDENT_JOINING),
            "parked_reqs": self.requests.count(S.PARKED),
            "demotions": self.demotions,
            "accounting_drifts": self.accounting_drifts,
        }
        if self.exactness is not None:
            stats.update(self.exactness.read())
        return stats

    # ------------------------------------------------------------ staging
    def admit_request_into_staging(self, req) -> None:
        """A request finished prefill (0.5.13 ``batch_result_processor``)."""
        idx = req.req_pool_idx
        first = self.req_to_token_pool.req_to_token[idx, 0]
        take = getattr(self.token_to_kv_pool_allocator, "take_prefill_claim", None)
        if take is not None:
            take(int(first))
        done_at = self.clock()
        if self.residency.admits(req):
            self.requests.record(idx).prefill_done_at = done_at
            return
        self.requests.admit(req, S.HOST_WAIT).prefill_done_at = done_at
        if self.requests.count(S.HOST_WAIT) == 1 and self._start_staging(req):
            return
        self.host_wait_events += 1  # waits behind others, or for host pages

    def _prefix_rows(self, idx: int, n: int):
        """(host rows, device rows) of a request's first ``n`` tokens (C4 rows
        for V4), host pages allocated as needed; None when the host pool has
        too few pages."""
        physical = self._mapping()[self._logical_ids(idx, n)]
        host = self.mem_pool_host.try_alloc_paged_token_slots(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx, 0,
            int(physical.numel()))
        return None if host is None else (host, physical)

    def _start_staging(self, req) -> bool:
        """HOST_WAIT -> STAGING when the host pool has the pages."""
        rows = self._prefix_rows(req.req_pool_idx, self.prefill_len(req))
        if rows is None:
            return False
        host, physical = rows
        start, done = self.streams.event(), self.streams.event()
        if self.streams.gpu:
            start.record()
            with self.streams.use(self.write_staging_stream):
                start.wait(self.write_staging_stream)
                self.mem_pool_host.backup_from_device_all_layer(
                    self.mem_pool_device, host, physical, io_backend="kernel")
                done.record()
                host.record_stream(self.write_staging_stream)
                physical.record_stream(self.write_staging_stream)
        else:
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host, physical, io_backend="kernel")
        self.host_bytes_written += int(physical.numel()) * self.item_size_bytes * self.layer_num
        self.requests.move(req, S.STAGING)
        self.ack_staging_queue.append(_Staging(done, req))
        return True

    def staged_requests(self) -> List[object]:
        """Requests past prefill that are not in the running batch yet: copying
        their prefill to host, waiting for host pages, ready to join, or
        parked on host."""
        return self.requests.in_state(*_NOT_IN_BATCH)

    def has_ongoing_staging(self) -> bool:
        return any(map(self.requests.count, _NOT_IN_BATCH))

    def collect_ready_reqs(self) -> List[object]:
        """Requests that join the running batch now (0.5.13 ``scheduler.py:2445``)."""
        r = self.requests
        ready = r.in_state(S.RESIDENT_JOINING, S.HOT_JOINING)
        for req in ready:
            r.move(req, S.RESIDENT if r.state_of(req) is S.RESIDENT_JOINING else S.HOT)
        for req in r.in_state(S.HOST_WAIT):
            if not self._start_staging(req):
                break
        if not self.ack_staging_queue and not r.count(S.PARKED):
            return self._joined(ready)
        done = 0
        for item in self.ack_staging_queue:
            if not item.event.query():
                break
            done += 1
        if self.tp_world_size > 1 and self.ack_staging_queue:
            # TP ranks hold the same requests in the same states (every
            # other input of these decisions - the queue, the pools, the
            # scheduler's demand - is rank-identical); only when each rank's
            # copies finish differs. Join what every rank has copied. With
            # nothing in copy (only parked requests) there is nothing to
            # agree on: no collective, so a step with parked requests does
            # not block on the slowest rank.
            t = torch.tensor(done, dtype=torch.int32)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
            done = int(t.item())
        staged = [self.ack_staging_queue.pop(0).req for _ in range(done)]
        return self._joined(ready + self.parking.admit(staged, running_extra=len(ready)))

    def _joined(self, reqs: List[object]) -> List[object]:
        """Count the join waits of ``reqs``, which join the running batch now."""
        if reqs:
            now = self.clock()
            for req in reqs:
                rec = self.requests.record(req.req_pool_idx)
                if rec is None or rec.prefill_done_at is None:
                    continue  # admitted from host (PD decode), not from prefill
                wait = now - rec.prefill_done_at
                rec.prefill_done_at = None
                self.joins += 1
                self.join_wait_s += wait
                self.join_wait_max_s = max(self.join_wait_max_s, wait)
        return reqs

    # -------------------------------------------------------- hot buffers
    def alloc_device_buffer(self, req) -> bool:
        """Turn the request's mapped rows into its hot buffer (fresh rows for
        what it lacks); False when the pool has no rows (accounting drift)."""
        idx = req.req_pool_idx
        if self.is_dsv4_hisparse:
            n_logical, size = self.prefill_len(req), self.padded_buffer_size
        else:
            n_logical = self.kv_allocated_len(req)
            size = self._buffer_size_for(n_logical)
        rows = self.token_to_kv_pool_allocator.alloc_device_buffer(
            self._logical_ids(idx, n_logical), size)
        if rows is None:
            return False
        self.tables.set_hot_buffer(idx, rows.to(torch.int64))
        return True

    def join_staged(self, req) -> bool:
        """STAGING -> HOT: prefill rows become the hot buffer."""
        if not self.alloc_device_buffer(req):
            return False
        self.requests.move(req, S.HOT).skip_first_backup = True
        return True

    def join_from_host(self, req) -> bool:
        """-> HOT for a request whose KV is all on host (PD decode, parked,
        resumed): a short one is loaded whole, a long one starts empty."""
        if not self.alloc_device_buffer(req):
            return False
        n = self.host_token_len(self.kv_allocated_len(req))
        if n <= self.device_buffer_size:
            self._preload_to_device_buffer(req, n)
        else:
            self.tables.forget_buffer_contents(req.req_pool_idx)
        rec = (self.requests.move(req, S.HOT) if self.requests.holds(req)
               else self.requests.admit(req, S.HOT))
        rec.skip_first_backup = True
        return True

    def prealloc_host_rows(self, req, fill_len: int) -> torch.Tensor:
        """PD decode prealloc (0.5.13 ``DecodePreallocQueue._pre_alloc``,
        patched): the host rows the prefill node writes the request's KV
        into, or, for a request resuming from retraction, the rows it kept
        (nothing new taken for what they hold). The request is held as
        TRANSFERRING from here, so every way out frees its host rows."""
        idx = req.req_pool_idx
        self.retain.adopt(req)
        rows = self.mem_pool_host.alloc_paged_token_slots(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx, 0,
            self.host_token_len(fill_len))
        self.requests.admit(req, S.TRANSFERRING)
        return rows

    def admit_request_direct(self, req) -> None:
        """PD decode: KV already on host (req_to_host_pool filled by the prealloc)."""
        if not self.join_from_host(req):
            if self.requests.holds(req):
                self.request_finished(req)  # and the host rows the prealloc gave it
            else:
                self._reset_slot(req.req_pool_idx)
            self._drift(req, f"no physical rows for the hot buffer of {req.rid}")

    def _preload_to_device_buffer(self, req, n: int) -> None:
        idx = req.req_pool_idx
        host = self.req_to_host_pool[idx, :n]
        dev = self.req_to_device_buffer[idx, :n]
        for layer in range(self.layer_num):
            self.mem_pool_host.load_to_device_per_layer(
                self.mem_pool_device, host, dev, layer, io_backend="kernel")
        self.host_bytes_read_staging += n * self.item_size_bytes * self.layer_num

    def _grow_device_buffers(self, seq_list, idx_list) -> None:
        """Short hot buffers grow to hold ``seq`` tokens (decode: one more a
        step; a verify step: its draft tokens, possibly past B, which takes
        the padded buffer at once)."""
        full = self.padded_buffer_size
        grows = []
        records = self.requests
        for seq, idx in zip(seq_list, idx_list):
            cap = int(self.tables.buffer_size_np[idx])
            if cap >= full:
                continue
            rec = records.record(idx)
            if rec is None or rec.state is not _HOT:
                continue
            need = self._buffer_size_for(seq)
            if need > cap:
                grows.append((idx, cap, need))
        total = sum(new - old for _, old, new in grows)
        if total <= 0:
            return
        rows = self.token_to_kv_pool_allocator.hisparse_attn_allocator.alloc(total)
        if rows is None:
            for idx, _, _ in grows:
                self._drift(records.record(idx).req, f"hot-buffer growth of {total} rows failed")
            return
        off = 0
        for idx, old, new in grows:
            self.tables.grow_hot_buffer(idx, old, new, rows[off: off + new - old])
            off += new - old

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices,
                               seq_lens_cpu, req_pool_indices_cpu) -> None:
        """Called by ``ScheduleBatch.prepare_for_decode`` after ``seq_lens += 1``."""
        if self.exactness is not None and not self.exactness.armed:
            self.exactness.arm()  # graph capture is over: real requests from here on
        if req_pool_indices_cpu is None:
            req_pool_indices_cpu = req_pool_indices.cpu()
        if seq_lens_cpu is None:
            seq_lens_cpu = seq_lens.cpu()
        seq_list, idx_list = seq_lens_cpu.tolist(), req_pool_indices_cpu.tolist()
        residency = self.residency
        if residency.count:
            if residency.all_mid_page(seq_list, idx_list):
                # Residents inside a page already mapped: nothing to do (the
                # common step for a lone request; everything below would
                # skip them one by one).
                return
            residency.grow(seq_list, idx_list, out_cache_loc)
        self._eager_backup_previous_token(seq_lens, req_pool_indices, seq_list, idx_list)
        mapping = self._mapping()
        if self.is_dsv4_hisparse:
            self._map_last_loc_dsv4(seq_lens, out_cache_loc, req_pool_indices, seq_list)
            return
        self._grow_device_buffers(seq_list, idx_list)
        B = self.device_buffer_size
        keep = range(len(idx_list))
        if residency.count:
            # Residents got their own rows above; the rest use the newest slot.
            keep = [i for i, idx in enumerate(idx_list) if not residency.holds(idx)]
            if not keep:
                return
            sel = device_index(keep, seq_lens.device)
            seq_lens, out_cache_loc, req_pool_indices = (
                seq_lens[sel], out_cache_loc[sel], req_pool_indices[sel])
        if all(seq_list[i] - 1 > B for i in keep):
            # Past the buffer the newest token always sits in slot B, whose
            # row the kernel's table already holds (set when the hot buffer
            # was made, or by the step that reached slot B: one token per
            # request per call): only the mapping changes.
            mapping[out_cache_loc] = self.tables.newest_slot_rows[req_pool_indices]
            return
        # Still inside the buffer (or entering slot B): the newest token's slot
        # moves with it, so slot B's table entry follows.
        pos = (seq_lens - 1).clamp(max=B)
        slot_rows = self.req_to_device_buffer[req_pool_indices, pos]
        self.req_device_buffer_token_locs[:, req_pool_indices, B] = slot_rows.to(torch.int32)
        mapping[out_cache_loc] = slot_rows

    def _map_last_loc_dsv4(self, seq_lens, out_cache_loc, req_pool_indices, seq_list) -> None:
        # Which requests start a compressed row, from the CPU lengths: asking
        # the device tensor would sync the stream every step.
        starts = [i for i, seq in enumerate(seq_list) if seq % self.compress_ratio == 0]
        if not starts:
            return
        active = device_index(starts, seq_lens.device)
        rpi = req_pool_indices[active]
        pos = (seq_lens[active] // self.compress_ratio - 1).clamp(max=self.device_buffer_size)
        rows = self.req_to_device_buffer[rpi, pos]
        self.req_device_buffer_token_locs[:, rpi, self.device_buffer_size] = rows.to(torch.int32)
        compressed = self.token_to_kv_pool_allocator.get_last_loc_compressed(out_cache_loc[active])
        self._mapping()[compressed] = rows

    def _eager_backup_previous_token(self, seq_lens, req_pool_indices, seq_list,
                                     idx_list) -> None:
        """Write the previous (compressed) token of each hot-buffer request through to host."""
        cr = self.compress_ratio
        get, host_len = self.requests.record, self.tables.host_len_np
        picks, positions = [], []
        for i, (seq, idx) in enumerate(zip(seq_list, idx_list)):
            rec = get(idx)
            if rec is None or rec.state is _RESIDENT:
                continue  # nothing goes to host while resident
            if rec.skip_first_backup:
                rec.skip_first_backup = False
                continue
            if (seq - 1) % cr:
                continue
            pos = (seq - 1) // cr - 1
            if pos >= host_len[idx]:  # first token of a host page
                rows = self.mem_pool_host.try_alloc_paged_token_slots(
                    self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx, pos, 1)
                if rows is None:
                    self._drift(rec.req, "host pool exhausted during write-through")
                    continue
            picks.append(i)
            positions.append(pos)
        if not picks:
            return
        dev = seq_lens.device
        if len(picks) == seq_lens.numel():
            rpi = req_pool_indices
        else:
            rpi = req_pool_indices[device_index(picks, dev)]
        pos = device_index(positions, dev)
        dev_rows = self.req_to_device_buffer[rpi, pos.clamp(max=self.device_buffer_size)]
        host = self.req_to_host_pool[rpi, pos]
        self.streams.wait_for_pending_backup()
        with self.streams.begin_write_through():
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host, dev_rows, io_backend="kernel")
            self.streams.end_write_through(host, dev_rows)
        self.host_bytes_written += len(picks) * self.item_size_bytes * self.layer_num

    def wait_for_pending_backup(self) -> None:
        """0.5.13 ``ModelRunner`` calls this before each forward."""
        self.streams.wait_for_pending_backup()

    # ------------------------------------------------------------ swap-in
    def swap_in_selected_pages(self, req_pool_indices, compressed_seq_lens, top_k_result,
                               layer_id: int) -> torch.Tensor:
        """Physical rows of the selected tokens, loading misses from host (per
        layer). With the IndexShare prefetch a shared layer resolves nothing:
        it waits for its replay of the anchor's plan and returns the anchor's
        output; an anchor with shared layers records the plan and launches
        their replays."""
        rows = top_k_result.size(0)  # requests x draft tokens in a verify step
        out = self.top_k_device_locs_buffer[:rows]
        prefetch = self.prefetch
        if prefetch is not None and prefetch.is_shared[layer_id]:
            prefetch.before_shared(layer_id)
            if self.exactness is not None:
                self._check_rows(req_pool_indices, compressed_seq_lens, top_k_result, out,
                                 layer_id)
            return out
        requests = req_pool_indices.size(0)
        draft_tokens = rows // max(requests, 1) if rows else 1
        if self.synthetic_trace is not None:
            if draft_tokens != 1:
                raise ValueError(f"{SYNTHETIC_TOPK_ENV} does not drive verify rows")
            # A shared layer selects what its anchor selected, synchronous or not.
            trace_layer = layer_id if self.index_roles is None \
                else self.index_roles.anchor_of[layer_id]
            top_k_result = synthetic_top_k.synthetic_top_k(
                req_pool_indices, compressed_seq_lens, trace_layer, self.synthetic_trace,
                self._synthetic_top_k[:rows, :top_k_result.size(1)])
        fn = self._swap_in_fn or _swap_in_kernel()
        extra = {} if self.swap_in_block_size is None else {"block_size": self.swap_in_block_size}
        if self.skip_io:
            extra["skip_io"] = True
        if draft_tokens != 1:
            extra["draft_tokens"] = draft_tokens
        if self.residency.enabled:
            extra.update(resident=self.req_resident,
                         req_to_token=self.req_to_token_pool.req_to_token,
                         token_to_row=self._mapping())
        records = prefetch is not None and prefetch.records_plan(layer_id)
        if records:
            prefetch.before_anchor()
            extra.update(prefetch.plan(requests))
        host_kv, device_kv = self._host_rows(layer_id), self._device_rows(layer_id)
        layout = "c4" if self.is_dsv4_hisparse else "rows"
        fn(
            top_k_tokens=top_k_result,
            slot_tokens=self.req_device_buffer_tokens[layer_id],
            slot_locs=self.req_device_buffer_token_locs[layer_id],
            lru=self.lru_slots[layer_id],
            host_locs=self.req_to_host_pool,
            host_kv=host_kv,
            device_kv=device_kv,
            req_pool_indices=req_pool_indices,
            seq_lens=compressed_seq_lens,
            num_real_reqs=self.num_real_reqs.tensor,
            out=out,
            layout=layout,
            tally=self._tally_of_layer[layer_id],
            **extra,
        )
        if records:
            prefetch.replay_followers(
                layer_id, requests, self.num_real_reqs.tensor,
                lambda layer: (self._host_rows(layer), self._device_rows(layer)), layout,
                _copy_planned_kernel())
        if self.exactness is not None:
            self.exactness.after_swap_in(
                top_k_result, out, req_pool_indices, compressed_seq_lens, layer_id,
                host_kv, device_kv, layout, draft_tokens)
        return out

    def _check_rows(self, req_pool_indices, seq_lens, top_k_result, out, layer_id) -> None:
        """The exactness check of a shared layer's rows (after its replay landed)."""
        rows = top_k_result.size(0)
        draft_tokens = rows // max(req_pool_indices.size(0), 1) if rows else 1
        if self.synthetic_trace is not None:
            top_k_result = self._synthetic_top_k[:rows, :top_k_result.size(1)]
        self.exactness.after_swap_in(
            top_k_result, out, req_pool_indices, seq_lens, layer_id,
            self._host_rows(layer_id), self._device_rows(layer_id), "rows", draft_tokens)

    def table_layer(self, layer_id: int) -> int:
        """The layer whose slot tables (``slot_tokens``, ``lru``) hold a
        layer's hot-buffer state: its anchor's while the prefetch runs."""
        return layer_id if self.prefetch is None else self.prefetch.table_layer(layer_id)

    def _host_rows(self, layer_id: int) -> torch.Tensor:
        buf = self.mem_pool_host.kv_buffer[layer_id]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    def _device_rows(self, layer_id: int) -> torch.Tensor:
        buf = self.mem_pool_device.kv_buffer[layer_id]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    # ------------------------------------------------------------ release
    def _reset_slot(self, idx: int) -> None:
        self.tables.reset(idx)
        self.mem_pool_host.release_request_rows(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx)

    def free_prefill_rows(self, req) -> None:
        """Free the device rows a request's prefill still holds (none once parked)."""
        logical = self.req_to_token_pool.req_to_token[req.req_pool_idx, : self.prefill_len(req)]
        logical = logical.to(torch.int64)
        if self.is_dsv4_hisparse:
            # free_hisparse takes full ids; the C4 rows are keyed by compressed ids.
            compressed = self.mem_pool_device.translate_loc_from_full_to_compressed(logical)
            self.token_to_kv_pool_allocator.free_compressed(compressed)
        else:
            self.token_to_kv_pool_allocator.free_hisparse(logical)

    def abort_staging_request(self, req) -> None:
        """Release a request that has not joined the batch (any state)."""
        self.request_finished(req)

    def retract_req(self, req) -> None:
        """0.5.13 ``ScheduleBatch.retract_decode``: release, or keep the KV on
        host on a PD decode node."""
        if self.retain.retains(req):
            self.retain.retract_to_host(req)
        else:
            self.request_finished(req)

    def request_finished(self, req) -> None:
        """Release everything a request holds, in whatever state it is. Safe
        for requests the coordinator never saw (finished right after prefill)
        and when called twice."""
        idx = req.req_pool_idx
        if idx is None:
            return
        state = self.requests.state_of(req)
        if state is None:
            return
        if state is S.STAGING or state is S.HOST_WAIT:
            if state is S.STAGING:
                self.ack_staging_queue = [s for s in self.ack_staging_queue if s.req is not req]
                if self.streams.gpu:
                    self.write_staging_stream.synchronize()
            self.free_prefill_rows(req)
        elif state is S.PARKED or state is S.TRANSFERRING:
            pass  # holds no device row; its host rows go below
        elif state.is_resident:
            self.streams.before_release()
            n = self.prefill_len(req) if state is S.RESIDENT_JOINING else self.kv_allocated_len(req)
            self.residency.unmap_page_tail(idx, n)
            self.token_to_kv_pool_allocator.free_hisparse(self._logical_ids(idx, n))
        else:  # HOT, HOT_JOINING
            self.streams.before_release()
            cap = int(self.req_device_buffer_size[idx])
            rows = self.req_to_device_buffer[idx, :cap].clone() if cap else None
            # The hot buffer's rows are freed below; drop the mapping to them.
            fill_at(self._mapping(), self._logical_ids(idx, self.kv_allocated_len(req)), 0)
            self.requests.release(req)
            # Freeing the rows and the host rows syncs the device: inside
            # SGLang's free group (a decode step's finishes) it waits until
            # the step's tokens are out. Until then nothing reaches the slot
            # or the rows: the request is no longer held, and SGLang hands
            # its slot out again only when it forms the next batch.
            self.token_to_kv_pool_allocator.release_after_group(
                lambda: self._release_hot_buffer(idx, rows))
            return
        self.requests.release(req)
        self._reset_slot(idx)

    def _release_hot_buffer(self, idx: int, rows: Optional[torch.Tensor]) -> None:
        """A finished hot-buffer request's rows and slot (its request table
        entry and mapping are gone already)."""
        if rows is not None:
            self.token_to_kv_pool_allocator.free_hisparse_indices(torch.unique(rows[rows > 0]))
        self._reset_slot(idx)

    def live_request_slots(self) -> List[int]:
        return self.requests.slots()

    def state_of(self, req) -> Optional[ReqState]:
        """The request's state (None: not held)."""
        return self.requests.state_of(req)

    def destroy(self) -> None:
        """Drain side streams, then release pinned host memory."""
        self.streams.synchronize()
        self.ack_staging_queue.clear()
        self.requests.clear()
        self.mem_pool_host.destroy()
