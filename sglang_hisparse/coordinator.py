"""HiSparse coordinator: per-request hot buffers, host backing and swap-in.

Lifecycle of a request (colocated):

1. prefill writes its KV into physical rows (allocator ``alloc_extend``);
   with residency on (the default for DSA), the request then simply keeps
   them: it decodes *resident*, its whole KV on the GPU, new tokens getting
   rows of their own, no host IO and no swap-in work (the kernel only
   translates positions). When rows run short (a prefill to admit, a
   resident to grow) the largest residents are *demoted*: their rows are
   copied to host in stream order and they continue from step 3, exactly
   like a staged request. Otherwise:
2. ``admit_request_into_staging`` copies every prefill row, all layers, to
   host on a side stream (an exhausted host pool parks the request in a
   host-wait list; it is retried, never failed);
3. ``collect_ready_reqs`` returns requests whose copy finished on every TP
   rank (count agreed with ``all_reduce(MIN)`` on the CPU group) after turning
   their prefill rows into a hot buffer (``alloc_device_buffer``), unless the
   hot buffer would take rows a waiting prompt needs: then the request is
   *parked* (all its rows freed, KV on host) and joins later with a fresh
   hot buffer (``parking.py``);
4. every decode step ``map_last_loc_to_buffer`` writes the previous token
   through to host (skipped on the first step after staging), grows the hot
   buffer of short requests and maps the new token to its slot (slot ``B`` =
   first slot of the extra page once the request is longer than the buffer);
5. the attention backend calls ``swap_in_selected_pages`` per layer; it
   dispatches to :func:`sglang_hisparse.kernels.swap_in_selected`;
6. finish / abort (waiting, staging, running) / retract release everything.

PD decode admits through ``admit_request_direct`` (KV already on host); a
request retracted there keeps its KV on host until it resumes
(``disaggregation.py``).

Drop-in for 0.5.13 ``HiSparseCoordinator`` (class REPLACE). Its call sites
in 0.5.13:
``model_runner.py:818`` (ctor), ``scheduler.py:469``
(``set_decode_producer_stream``), ``scheduler.py:2445``
(``collect_ready_reqs``), ``scheduler.py:3366`` (``has_ongoing_staging``),
``schedule_batch.py:1515`` (``retract_req``), ``schedule_batch.py:2568``
(``map_last_loc_to_buffer``), ``batch_result_processor.py:93,837``
(``request_finished``), ``batch_result_processor.py:240``
(``admit_request_into_staging``), ``pool_stats_observer.py:230``
(``get_token_stats``), ``dsa_backend.py:1663`` and ``dsv4/indexer.py:580,619``
(``swap_in_selected_pages``, ``raw_indices_buffer``),
``model_runner.py:3533-3534,3569`` (``wait_for_pending_backup``,
``num_real_reqs``), ``cuda_graph_runner.py:974,1161`` (``num_real_reqs``),
``disaggregation/decode.py:393,406,822,1326-1331,1641,1663,1916``
(``mem_pool_host``, ``padded_buffer_size``, ``req_to_host_pool``,
``req_to_host_pool_allocated_len``, ``host_token_len``, ``request_finished``,
``admit_request_direct``), ``scheduler_pp_mixin.py:1398``
(``admit_request_direct``). ``sglang_hisparse.hooks`` adds ``abort_request``
handling and the logical ``max_token_pool_size``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from sglang_hisparse import metrics
from sglang_hisparse.config import PARKING_ENV, RESIDENCY_ENV, SKIP_IO_ENV
from sglang_hisparse.disaggregation import RetractToHostMixin, pd_decode_from_server_args
from sglang_hisparse.host_pool import HiSparseC4HostPool, HiSparseMLAHostPool
from sglang_hisparse.parking import ParkingMixin
from sglang_hisparse.residency import ResidencyMixin

logger = logging.getLogger(__name__)


class HiSparseTokenStats(NamedTuple):
    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


# ---------------------------------------------------------------- streams
class _DoneEvent:
    """CPU stand-in for a device event; ``pending`` polls let tests keep a
    staging copy "in flight" for a while."""

    def __init__(self, pending: int = 0):
        self.pending = pending

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        if self.pending > 0:
            self.pending -= 1
            return False
        return True

    def synchronize(self):
        self.pending = 0


class _Streams:
    """Device streams/events on CUDA; synchronous no-ops elsewhere."""

    def __init__(self, device):
        self.gpu = str(device).startswith("cuda") and torch.cuda.is_available()
        self.cpu_event_delay: Callable[[], int] = lambda: 0
        if self.gpu:
            self.staging = torch.cuda.Stream()
            self.backup = torch.cuda.Stream()

    def event(self):
        return torch.cuda.Event() if self.gpu else _DoneEvent(self.cpu_event_delay())

    def current(self):
        return torch.cuda.current_stream() if self.gpu else None

    def use(self, stream):
        if self.gpu:
            return torch.cuda.stream(stream)
        import contextlib

        return contextlib.nullcontext()


class RealRequestCount:
    """The int32 [1] device scalar the swap-in kernel reads as the number of
    real (not CUDA-graph padding) rows, behind SGLang's ``num_real_reqs.fill_(n)``.

    SGLang 0.5.13 fills it twice per decode step (model runner, graph runner),
    almost always with the value it already holds; each fill is a kernel
    launch on the scheduler's critical path. Only this object writes the
    tensor, so a fill that would not change it is skipped.
    """

    def __init__(self, device):
        self.tensor = torch.zeros(1, dtype=torch.int32, device=device)
        self._value = 0

    def fill_(self, value) -> torch.Tensor:
        value = int(value)
        if value != self._value:
            self.tensor.fill_(value)
            self._value = value
        return self.tensor

    def item(self) -> int:
        return self._value


@dataclass
class _Staging:
    event: object
    req: object


def _swap_in_kernel():
    from sglang_hisparse import kernels

    return kernels.swap_in_selected


def _configured_swap_in_block_size() -> Optional[int]:
    # 0.5.13 builds the coordinator with a fixed set of kwargs, so the
    # swap_in_block_size field of --hisparse-config is read from the
    # process-wide server args (None when there are none, e.g. in tests).
    try:
        from sglang.srt.server_args import get_global_server_args

        from sglang_hisparse.arg_hooks.sparse_config import resolved_hisparse_config

        return resolved_hisparse_config(get_global_server_args()).swap_in_block_size
    except Exception:
        return None


class HiSparseCoordinator(ResidencyMixin, ParkingMixin, RetractToHostMixin):
    """Replacement for 0.5.13 ``HiSparseCoordinator`` (same constructor)."""

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
        host_pool=None,
        swap_in_fn: Optional[Callable] = None,
        swap_in_block_size: Optional[int] = None,
        residency: Optional[bool] = None,
        pd_decode: Optional[bool] = None,
    ):
        if device_buffer_size < top_k:
            raise ValueError(
                f"device_buffer_size ({device_buffer_size}) must be >= top_k ({top_k})"
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = alloc = token_to_kv_pool_allocator
        self.top_k = top_k
        self.device_buffer_size = device_buffer_size
        self.device = device
        self.compress_ratio = getattr(alloc, "compress_ratio", 1)
        self.is_dsv4_hisparse = self.compress_ratio != 1
        self._swap_in_fn = swap_in_fn
        self.swap_in_block_size = swap_in_block_size or _configured_swap_in_block_size()
        # Timing probe: the swap-in resolves and publishes slots but skips its
        # host->device copies (outputs wrong; ours vs ours-without-IO shows
        # what the copies cost).
        self.skip_io = os.environ.get(SKIP_IO_ENV) == "1"
        # DeepSeek-V4's C4 rows are compressed per page of tokens; residency
        # is implemented for DSA rows only.
        if residency is None:
            residency = os.environ.get(RESIDENCY_ENV, "1") != "0"
        self.residency = bool(residency) and not self.is_dsv4_hisparse
        # A PD decode node keeps a retracted request's KV on host (disaggregation.py).
        self.pd_decode = pd_decode_from_server_args() if pd_decode is None else bool(pd_decode)
        self._pending_retained = None
        if self.skip_io:
            logger.warning("%s=1: swap-in host copies are skipped; outputs are invalid "
                           "(for timing only)", SKIP_IO_ENV)

        if self.is_dsv4_hisparse:
            # 0.5.13 DeepSeekV4HiSparseTokenToKVPoolAllocator: C4 physical pool.
            self.mem_pool_device = alloc.hisparse_kvcache
            page_size = self.mem_pool_device.page_size
            pages = -(-(alloc.size_full // self.compress_ratio) // page_size)
            self.mem_pool_host = host_pool or HiSparseC4HostPool(
                device_buffers=self.mem_pool_device.kv_buffer, num_host_pages=pages,
                page_size=page_size,
            )
            self.item_size_bytes = (
                self.mem_pool_device.kv_cache_total_dim
                * self.mem_pool_device.store_dtype.itemsize
            )
        else:
            self.mem_pool_device = alloc.get_kvcache()
            self.mem_pool_host = host_pool or HiSparseMLAHostPool(
                device_pool=self.mem_pool_device,
                host_to_device_ratio=host_to_device_ratio,
                host_size=0,
                page_size=self.mem_pool_device.page_size,
                override_kv_cache_dim=self.mem_pool_device.kv_cache_dim,
            )
            self.item_size_bytes = self.mem_pool_host.item_bytes
        self.page_size = self.mem_pool_device.page_size
        self.layer_num = self.mem_pool_device.layer_num
        # Extra page: its first slot holds the newest token of a long request.
        self.padded_buffer_size = device_buffer_size + self.page_size

        max_reqs = req_to_token_pool.req_to_token.shape[0]
        max_ctx = req_to_token_pool.max_context_len
        max_host_ctx = -(-max_ctx // self.compress_ratio)
        B, P = device_buffer_size, self.padded_buffer_size
        i32 = dict(dtype=torch.int32, device=device)

        self.req_to_device_buffer = torch.zeros((max_reqs, P), dtype=torch.int64, device=device)
        # Slot B's row per request (a view): where a long request's newest token lives.
        self._newest_slot_rows = self.req_to_device_buffer[:, B]
        self.req_device_buffer_size = torch.zeros(max_reqs, dtype=torch.int64)
        self.req_to_host_pool = torch.full(
            (max_reqs, max_host_ctx + self.page_size), -1, dtype=torch.int64, device=device
        )
        self.req_to_host_pool_allocated_len = torch.zeros(max_reqs, dtype=torch.int64)
        # numpy views of the two CPU tables (same memory): per-element reads
        # on the per-step paths cost ~0.1 us instead of a tensor index's ~2 us.
        self._buffer_size_np = self.req_device_buffer_size.numpy()
        self._host_len_np = self.req_to_host_pool_allocated_len.numpy()
        # Per layer swap-in state (the kernel's slot_tokens / slot_locs / lru).
        self.req_device_buffer_tokens = torch.full((self.layer_num, max_reqs, P), -1, **i32)
        self.req_device_buffer_token_locs = torch.full((self.layer_num, max_reqs, P), -1, **i32)
        self._lru_init = torch.arange(B, dtype=torch.int16, device=device)
        self.lru_slots = self._lru_init.repeat(self.layer_num, max_reqs, 1).contiguous()
        self._arange_i32 = torch.arange(P, **i32)
        self.top_k_device_locs_buffer = torch.full((max_reqs, top_k), -1, **i32)
        self.raw_indices_buffer = torch.full((max_reqs, top_k), -1, **i32)
        self.num_real_reqs = RealRequestCount(device)
        # Residency: the kernel's per-slot flag, and rows held per resident.
        self.req_resident = torch.zeros(max_reqs, **i32)
        self._resident_rows: Dict[int, int] = {}
        self._ready: List[object] = []  # past prefill, not staged, not yet collected
        # Parking: staged requests waiting on host, holding no device row.
        self._parked: Dict[int, object] = {}  # req_pool_idx -> request, oldest first
        self._prefill_demand = None
        self.prefill_demand_installed = False
        self.parking = os.environ.get(PARKING_ENV, "1") != "0"
        self.demotions = 0

        self._streams = _Streams(device)
        self.write_staging_stream = getattr(self._streams, "staging", None)
        self.decode_backup_stream = getattr(self._streams, "backup", None)
        self.decode_producer_stream = None
        self._backup_done_event = None

        self.tp_group = tp_group
        self.tp_world_size = 1
        if tp_group is not None and torch.distributed.is_initialized():
            self.tp_world_size = torch.distributed.get_world_size(group=tp_group)

        self.ack_staging_queue: List[_Staging] = []
        self._host_wait: List[object] = []  # staged but no host pages yet
        self._live: Dict[int, object] = {}  # req_pool_idx -> Req (staging or active)
        self._skip_first_backup = [False] * max_reqs

        # The kernel's tally of (selected tokens, misses), summed over layers
        # and steps on the device: the decode path never syncs for it.
        self._tally = torch.zeros(2, dtype=torch.int64, device=device)
        self._tally_host = torch.zeros(2, dtype=torch.int64, pin_memory=self._tally.is_cuda)
        self._tally_copy = None  # CUDA event of the copy into _tally_host in flight
        self._tally_seen = [0, 0]
        self.host_bytes_written = 0
        self.host_bytes_read_staging = 0  # preload (direct admission)
        self.host_wait_events = 0

        metrics.register_coordinator(self)

        if hasattr(alloc, "set_reservation_provider"):
            alloc.set_reservation_provider(self._owed_tokens)
            alloc.attach_host_pool(self.mem_pool_host, self.padded_buffer_size)
            if self.residency:
                alloc.set_residency(self.reclaimable_rows, self.reclaim_rows)
            if self.pd_decode and not self.is_dsv4_hisparse:
                alloc.set_retraction(self.take_retained, self.restore_retained)

    # ------------------------------------------------------------ helpers
    def _page_up(self, n: int) -> int:
        return -(-int(n) // self.page_size) * self.page_size

    def host_token_len(self, kv_allocated_len: int) -> int:
        return kv_allocated_len // self.compress_ratio if self.is_dsv4_hisparse else kv_allocated_len

    def _mapping(self) -> torch.Tensor:
        alloc = self.token_to_kv_pool_allocator
        m = getattr(alloc, "full_to_hisparse_device_index_mapping", None)
        return m if m is not None else self.mem_pool_device.full_to_hisparse_device_index_mapping

    def _owed_tokens(self):
        """(physical, host) tokens live requests may still claim; see allocator.
        The scheduler asks several times a step: one loop, state read once."""
        phys = host = 0
        P = self.padded_buffer_size
        page_up, host_tokens = self._page_up, self.host_token_len
        resident, parked = self._resident_rows, self._parked
        buffer_size, host_len = self._buffer_size_np, self._host_len_np
        for idx, req in self._live.items():
            if idx in resident:
                held = resident[idx]
            elif idx in parked:
                held = P  # claims rows only when it joins (checked then)
            elif getattr(req, "hisparse_staging", False):
                # Rows it still holds from prefill, in this pool's units (C4 rows for V4).
                held = page_up(host_tokens(req.fill_len))
            else:
                held = int(buffer_size[idx])
            if held < P:
                phys += P - held
            need = page_up(host_tokens(req.kv_allocated_len)) - int(host_len[idx])
            if need > 0:
                host += need
        return phys, host

    def _buffer_size_for(self, num_tokens: int) -> int:
        size = min(self._page_up(num_tokens), self.device_buffer_size)
        return self.padded_buffer_size if size == self.device_buffer_size else size

    def set_decode_producer_stream(self, stream) -> None:
        self.decode_producer_stream = stream

    def set_cpu_staging_delay(self, fn: Callable[[], int]) -> None:
        """Tests: number of polls a CPU staging copy stays "in flight"."""
        self._streams.cpu_event_delay = fn

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

    def _read_tally(self) -> List[int]:
        """The kernel's (selected, misses) counts without waiting on the GPU:
        each call starts a copy to pinned memory and returns what the last
        finished copy saw, so on a GPU the counts trail by one reading (a
        decode log interval). A sync here would stall the scheduler and cost
        the decode step it overlaps with."""
        if not self._tally.is_cuda:
            return self._tally.tolist()
        if self._tally_copy is not None and self._tally_copy.query():
            self._tally_seen = self._tally_host.tolist()
            self._tally_copy = None
        if self._tally_copy is None:
            self._tally_host.copy_(self._tally, non_blocking=True)
            self._tally_copy = torch.cuda.Event()
            self._tally_copy.record()
        return list(self._tally_seen)

    def get_hisparse_stats(self) -> dict:
        """Counters for the decode log line / Prometheus (no device sync; the
        kernel's hit/miss counts trail by one reading on a GPU)."""
        active = [i for i, r in self._live.items()
                  if not getattr(r, "hisparse_staging", False) and i not in self._resident_rows]
        cap = int(self.req_device_buffer_size[active].sum()) if active else 0
        selected, misses = self._read_tally()
        return {
            "hits": selected - misses,
            "misses": misses,
            "host_bytes_read": misses * self.item_size_bytes + self.host_bytes_read_staging,
            "host_bytes_written": self.host_bytes_written,
            "hot_buffer_tokens": cap,
            "hot_buffer_occupancy": cap / (len(active) * self.padded_buffer_size) if active else 0.0,
            "active_reqs": len(active),
            "staging_reqs": len(self.ack_staging_queue),
            "host_wait_reqs": len(self._host_wait),
            "host_wait_events": self.host_wait_events,
            "resident_reqs": len(self._resident_rows),
            "parked_reqs": len(self._parked),
            "demotions": self.demotions,
        }

    # ------------------------------------------------------------ staging
    def admit_request_into_staging(self, req) -> None:
        req.hisparse_staging = True
        idx = req.req_pool_idx
        self._live[idx] = req
        first = self.req_to_token_pool.req_to_token[idx, 0]
        take = getattr(self.token_to_kv_pool_allocator, "take_prefill_claim", None)
        if take is not None:
            take(int(first))
        if self.residency and not self.prefill_pending():
            # Keep the prefill rows: decode resident until rows run short
            # (not while other prompts wait for rows: see parking.py).
            self._resident_rows[idx] = self._page_up(req.fill_len)
            self.req_resident[idx] = 1
            self._map_page_tail(idx, req.fill_len)
            self._ready.append(req)
            return
        if self._host_wait or not self._start_staging(req):
            self._host_wait.append(req)
            self.host_wait_events += 1

    def _prefix_rows(self, idx: int, n: int):
        """(host rows, device rows) of a request's first ``n`` tokens (C4 rows
        for V4), host pages allocated as needed; None when the host pool has
        too few pages."""
        logical = self.req_to_token_pool.req_to_token[idx, :n].to(torch.int64)
        if self.is_dsv4_hisparse:
            logical = self.mem_pool_device.translate_loc_from_full_to_compressed(logical)
        physical = self._mapping()[logical]
        host = self.mem_pool_host.try_alloc_paged_token_slots(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx, 0,
            int(physical.numel()),
        )
        return None if host is None else (host, physical)

    def _start_staging(self, req) -> bool:
        rows = self._prefix_rows(req.req_pool_idx, req.fill_len)
        if rows is None:
            return False
        host, physical = rows
        start, done = self._streams.event(), self._streams.event()
        if self._streams.gpu:
            start.record()
            with self._streams.use(self.write_staging_stream):
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
        self.ack_staging_queue.append(_Staging(done, req))
        return True

    def staged_requests(self) -> List[object]:
        """Requests past prefill that are not in the running batch yet: copying
        their prefill to host, waiting for host pages, ready to join, or
        parked on host."""
        return ([s.req for s in self.ack_staging_queue] + list(self._host_wait)
                + list(self._ready) + list(self._parked.values()))

    def has_ongoing_staging(self) -> bool:
        return bool(self.ack_staging_queue or self._host_wait or self._ready or self._parked)

    def collect_ready_reqs(self) -> List[object]:
        ready, self._ready = self._ready, []
        for req in ready:
            req.hisparse_staging = False
        while self._host_wait and self._start_staging(self._host_wait[0]):
            self._host_wait.pop(0)
        if not self.ack_staging_queue and not self._parked:
            return ready
        done = 0
        for item in self.ack_staging_queue:
            if not item.event.query():
                break
            done += 1
        if self.tp_world_size > 1:
            t = torch.tensor(done, dtype=torch.int32)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
            done = int(t.item())
        staged = [self.ack_staging_queue.pop(0).req for _ in range(done)]
        demand = self._demand() if (staged or self._parked) else None
        # The batch as it will be: the running requests plus those joining now.
        running = (demand.running if demand is not None else 0) + len(ready)
        # Parked requests first: they finished staging earlier.
        joined = self._unpark(demand, running)
        ready += joined
        running += len(joined)
        for req in staged:
            if not self._may_join(req, demand, running, parked=False):
                self._park(req)
                continue
            self.alloc_device_buffer(req)
            self._skip_first_backup[req.req_pool_idx] = True
            req.hisparse_staging = False
            ready.append(req)
            running += 1
        return ready

    # -------------------------------------------------------- hot buffers
    def alloc_device_buffer(self, req) -> None:
        idx = req.req_pool_idx
        if self.is_dsv4_hisparse:
            n_logical, size = req.fill_len, self.padded_buffer_size
        else:
            n_logical = req.kv_allocated_len
            size = self._buffer_size_for(n_logical)
        logical = self.req_to_token_pool.req_to_token[idx, :n_logical].to(torch.int64)
        if self.is_dsv4_hisparse:
            logical = self.mem_pool_device.translate_loc_from_full_to_compressed(logical)
        rows = self.token_to_kv_pool_allocator.alloc_device_buffer(logical, size)
        if rows is None:
            raise RuntimeError(
                f"HiSparse: no physical rows for the hot buffer of {req.rid} (size {size}); "
                "admission accounting was bypassed"
            )
        rows = rows.to(torch.int64)
        self.req_to_device_buffer[idx, :size] = rows
        self.req_device_buffer_size[idx] = size
        held = min(size, self.device_buffer_size)
        self.req_device_buffer_tokens[:, idx, :] = -1
        self.req_device_buffer_tokens[:, idx, :held] = self._arange_i32[:held]
        self.req_device_buffer_token_locs[:, idx, :] = -1
        self.req_device_buffer_token_locs[:, idx, :size] = rows.to(torch.int32)
        self.lru_slots[:, idx, :].copy_(self._lru_init)
        self._live[idx] = req

    def admit_request_direct(self, req) -> None:
        """PD decode: KV already on host (req_to_host_pool filled by the prealloc)."""
        self._live[req.req_pool_idx] = req
        self._join_from_host(req)

    def _join_from_host(self, req) -> None:
        """A fresh hot buffer for a request whose KV is all on host (PD decode,
        parked): a short one is loaded whole, a long one starts empty."""
        self.alloc_device_buffer(req)
        n = self.host_token_len(req.kv_allocated_len)
        if n <= self.device_buffer_size:
            self._preload_to_device_buffer(req, n)
        else:
            # Nothing on the device: every top-k token is a miss served from host.
            self.req_device_buffer_tokens[:, req.req_pool_idx, :] = -1
        req.hisparse_staging = False
        self._skip_first_backup[req.req_pool_idx] = True

    def _preload_to_device_buffer(self, req, n: int) -> None:
        idx = req.req_pool_idx
        host = self.req_to_host_pool[idx, :n]
        dev = self.req_to_device_buffer[idx, :n]
        for layer in range(self.layer_num):
            self.mem_pool_host.load_to_device_per_layer(
                self.mem_pool_device, host, dev, layer, io_backend="kernel")
        self.host_bytes_read_staging += n * self.item_size_bytes * self.layer_num

    def _grow_device_buffers(self, seq_list, idx_list) -> None:
        B = self.device_buffer_size
        grows = []
        for seq, idx in zip(seq_list, idx_list):
            if idx in self._resident_rows:
                continue
            cap = int(self._buffer_size_np[idx])
            if seq <= B and seq > cap:
                grows.append((idx, cap, self._buffer_size_for(seq)))
        total = sum(new - old for _, old, new in grows)
        if total <= 0:
            return
        rows = self.token_to_kv_pool_allocator.hisparse_attn_allocator.alloc(total)
        if rows is None:
            raise RuntimeError(f"HiSparse: hot-buffer growth of {total} rows failed")
        off = 0
        for idx, old, new in grows:
            chunk = rows[off : off + new - old]
            off += new - old
            self.req_to_device_buffer[idx, old:new] = chunk
            self.req_device_buffer_token_locs[:, idx, old:new] = chunk.to(torch.int32)
            hi = min(new, B)
            if hi > old:
                self.req_device_buffer_tokens[:, idx, old:hi] = self._arange_i32[old:hi]
            self.req_device_buffer_size[idx] = new

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices,
                               seq_lens_cpu, req_pool_indices_cpu) -> None:
        """Called by ``ScheduleBatch.prepare_for_decode`` after ``seq_lens += 1``."""
        if req_pool_indices_cpu is None:
            req_pool_indices_cpu = req_pool_indices.cpu()
        if seq_lens_cpu is None:
            seq_lens_cpu = seq_lens.cpu()
        seq_list, idx_list = seq_lens_cpu.tolist(), req_pool_indices_cpu.tolist()
        resident = self._resident_rows
        if resident:
            ps = self.page_size
            if all(idx in resident and (seq - 1) % ps for seq, idx in zip(seq_list, idx_list)):
                # Residents inside a page already mapped: nothing to do (the
                # common step for a lone request; everything below would
                # skip them one by one).
                return
            self._grow_residents(seq_list, idx_list, out_cache_loc)
        self._eager_backup_previous_token(seq_lens, req_pool_indices, seq_list, idx_list)
        mapping = self._mapping()
        if self.is_dsv4_hisparse:
            self._map_last_loc_dsv4(seq_lens, out_cache_loc, req_pool_indices)
            return
        self._grow_device_buffers(seq_list, idx_list)
        B = self.device_buffer_size
        keep = range(len(idx_list))
        if resident:
            # Residents got their own rows above; the rest use the newest slot.
            keep = [i for i, idx in enumerate(idx_list) if idx not in resident]
            if not keep:
                return
            sel = torch.tensor(keep, dtype=torch.int64, device=seq_lens.device)
            seq_lens, out_cache_loc, req_pool_indices = (
                seq_lens[sel], out_cache_loc[sel], req_pool_indices[sel])
        if all(seq_list[i] - 1 > B for i in keep):
            # Past the buffer the newest token always sits in slot B, whose
            # row the kernel's table already holds (set when the hot buffer
            # was made, or by the step that reached slot B: one token per
            # request per call): only the mapping changes.
            mapping[out_cache_loc] = self._newest_slot_rows[req_pool_indices]
            return
        # Still inside the buffer (or entering slot B): the newest token's slot
        # moves with it, so slot B's table entry follows.
        pos = (seq_lens - 1).clamp(max=B)
        slot_rows = self.req_to_device_buffer[req_pool_indices, pos]
        self.req_device_buffer_token_locs[:, req_pool_indices, B] = slot_rows.to(torch.int32)
        mapping[out_cache_loc] = slot_rows

    def _map_last_loc_dsv4(self, seq_lens, out_cache_loc, req_pool_indices) -> None:
        active = seq_lens % self.compress_ratio == 0
        if not bool(active.any()):
            return
        rpi = req_pool_indices[active]
        pos = (seq_lens[active] // self.compress_ratio - 1).clamp(max=self.device_buffer_size)
        rows = self.req_to_device_buffer[rpi, pos]
        self.req_device_buffer_token_locs[:, rpi, self.device_buffer_size] = rows.to(torch.int32)
        compressed = self.token_to_kv_pool_allocator.get_last_loc_compressed(out_cache_loc[active])
        self._mapping()[compressed] = rows

    def _eager_backup_previous_token(self, seq_lens, req_pool_indices, seq_list,
                                     idx_list) -> None:
        """Write the previous (compressed) token of each request through to host."""
        cr = self.compress_ratio
        picks, positions = [], []
        for i, (seq, idx) in enumerate(zip(seq_list, idx_list)):
            if idx in self._resident_rows:
                continue  # nothing goes to host while resident
            if self._skip_first_backup[idx]:
                self._skip_first_backup[idx] = False
                continue
            if (seq - 1) % cr:
                continue
            pos = (seq - 1) // cr - 1
            if pos >= self._host_len_np[idx]:  # first token of a host page
                rows = self.mem_pool_host.try_alloc_paged_token_slots(
                    self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx, pos, 1)
                if rows is None:
                    raise RuntimeError(
                        "HiSparse: host pool exhausted during write-through; admission "
                        "accounting was bypassed")
            picks.append(i)
            positions.append(pos)
        if not picks:
            return
        dev = seq_lens.device
        if len(picks) == seq_lens.numel():
            rpi = req_pool_indices
        else:
            rpi = req_pool_indices[torch.tensor(picks, dtype=torch.int64, device=dev)]
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        dev_rows = self.req_to_device_buffer[rpi, pos.clamp(max=self.device_buffer_size)]
        host = self.req_to_host_pool[rpi, pos]
        self.wait_for_pending_backup()
        if self._streams.gpu:
            cur = torch.cuda.current_stream()
            with torch.cuda.stream(self.decode_backup_stream):
                self.decode_backup_stream.wait_stream(cur)
                if self.decode_producer_stream is not None:
                    self.decode_backup_stream.wait_stream(self.decode_producer_stream)
                self.mem_pool_host.backup_from_device_all_layer(
                    self.mem_pool_device, host, dev_rows, io_backend="kernel")
                self._backup_done_event = torch.cuda.Event()
                self._backup_done_event.record()
                host.record_stream(self.decode_backup_stream)
                dev_rows.record_stream(self.decode_backup_stream)
        else:
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host, dev_rows, io_backend="kernel")
        self.host_bytes_written += len(picks) * self.item_size_bytes * self.layer_num

    def wait_for_pending_backup(self) -> None:
        if self._backup_done_event is not None:
            self._backup_done_event.wait(torch.cuda.current_stream())
            self._backup_done_event = None

    # ------------------------------------------------------------ swap-in
    def swap_in_selected_pages(self, req_pool_indices, compressed_seq_lens, top_k_result,
                               layer_id: int) -> torch.Tensor:
        """Physical rows of the selected tokens, loading misses from host (per layer)."""
        bs = req_pool_indices.size(0)
        out = self.top_k_device_locs_buffer[:bs]
        fn = self._swap_in_fn or _swap_in_kernel()
        extra = {} if self.swap_in_block_size is None else {"block_size": self.swap_in_block_size}
        if self.skip_io:
            extra["skip_io"] = True
        if self.residency:
            extra.update(resident=self.req_resident,
                         req_to_token=self.req_to_token_pool.req_to_token,
                         token_to_row=self._mapping())
        fn(
            top_k_tokens=top_k_result,
            slot_tokens=self.req_device_buffer_tokens[layer_id],
            slot_locs=self.req_device_buffer_token_locs[layer_id],
            lru=self.lru_slots[layer_id],
            host_locs=self.req_to_host_pool,
            host_kv=self._host_rows(layer_id),
            device_kv=self._device_rows(layer_id),
            req_pool_indices=req_pool_indices,
            seq_lens=compressed_seq_lens,
            num_real_reqs=self.num_real_reqs.tensor,
            out=out,
            layout="c4" if self.is_dsv4_hisparse else "rows",
            tally=self._tally,
            **extra,
        )
        return out

    def _host_rows(self, layer_id: int) -> torch.Tensor:
        buf = self.mem_pool_host.kv_buffer[layer_id]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    def _device_rows(self, layer_id: int) -> torch.Tensor:
        buf = self.mem_pool_device.kv_buffer[layer_id]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    # ------------------------------------------------------------ release
    def _reset_rows(self, idx: int) -> None:
        self._resident_rows.pop(idx, None)
        self.req_resident[idx] = 0
        self.req_device_buffer_tokens[:, idx, :] = -1
        self.req_device_buffer_token_locs[:, idx, :] = -1
        self.req_to_device_buffer[idx, :] = 0
        self.req_device_buffer_size[idx] = 0
        self.lru_slots[:, idx, :].copy_(self._lru_init)
        self._skip_first_backup[idx] = False
        self.mem_pool_host.release_request_rows(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, idx)

    def abort_staging_request(self, req) -> None:
        """Drop a request that is staging (or waiting for host pages)."""
        self.ack_staging_queue = [s for s in self.ack_staging_queue if s.req is not req]
        self._host_wait = [r for r in self._host_wait if r is not req]
        self._ready = [r for r in self._ready if r is not req]
        self._drop_parked(req)
        idx = req.req_pool_idx
        if idx not in self._resident_rows and int(self.req_device_buffer_size[idx]) > 0:
            # Demoted while waiting to join the batch: it holds a hot buffer.
            req.hisparse_staging = False
            self.request_finished(req)
            return
        if self._streams.gpu:
            self.write_staging_stream.synchronize()
        if self._live.get(idx) is req:
            del self._live[idx]
        if idx in self._resident_rows:  # resident, not joined yet: no decode step
            self._unmap_page_tail(idx, req.fill_len)
        self._free_prefill_rows(req)
        self._reset_rows(idx)
        req.hisparse_staging = False

    def _free_prefill_rows(self, req) -> None:
        """Free the device rows a request's prefill still holds (none once parked)."""
        logical = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.fill_len]
        logical = logical.to(torch.int64)
        if self.is_dsv4_hisparse:
            # free_hisparse takes full ids; the C4 rows are keyed by compressed ids.
            compressed = self.mem_pool_device.translate_loc_from_full_to_compressed(logical)
            self.token_to_kv_pool_allocator.free_compressed(compressed)
        else:
            self.token_to_kv_pool_allocator.free_hisparse(logical)

    def retract_req(self, req) -> None:
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        elif self._retains_on_retract(req):
            self._retract_to_host(req)
        else:
            self.request_finished(req)

    def request_finished(self, req) -> None:
        """Release a request's hot buffer and host rows. Safe to call for requests
        the coordinator never saw (finished right after prefill) and twice."""
        idx = req.req_pool_idx
        if idx is None or self._live.get(idx) is not req:
            return
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
            return
        if self._ready:  # finished or retracted before it joined the batch
            self._ready = [r for r in self._ready if r is not req]
        if self._streams.gpu:
            if self.decode_producer_stream is not None:
                torch.cuda.current_stream().wait_stream(self.decode_producer_stream)
            self.wait_for_pending_backup()
        del self._live[idx]
        if idx in self._resident_rows:
            self._unmap_page_tail(idx, req.kv_allocated_len)
            logical = self.req_to_token_pool.req_to_token[idx, : req.kv_allocated_len]
            self.token_to_kv_pool_allocator.free_hisparse(logical.to(torch.int64))
            self._reset_rows(idx)
            return
        cap = int(self.req_device_buffer_size[idx])
        if cap:
            rows = self.req_to_device_buffer[idx, :cap]
            self.token_to_kv_pool_allocator.free_hisparse_indices(torch.unique(rows[rows > 0]))
        logical = self.req_to_token_pool.req_to_token[idx, : req.kv_allocated_len].to(torch.int64)
        if self.is_dsv4_hisparse:
            logical = self.mem_pool_device.translate_loc_from_full_to_compressed(logical)
        self._mapping()[logical] = 0  # the hot buffer rows are freed above
        self._reset_rows(idx)

    def live_request_slots(self) -> List[int]:
        return sorted(self._live)

    def destroy(self) -> None:
        """Drain side streams, then release pinned host memory."""
        if self._streams.gpu:
            self.write_staging_stream.synchronize()
            self.decode_backup_stream.synchronize()
        self.ack_staging_queue.clear()
        self._host_wait.clear()
        self._ready.clear()
        self._parked.clear()
        self.mem_pool_host.destroy()
