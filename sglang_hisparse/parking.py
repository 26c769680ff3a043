"""Parking: a staged request waits on host while prefills need the rows.

Why. A request that joins the decode batch takes a hot buffer (``B`` plus a
page of rows) until it finishes, and a prompt being prefilled holds one row
per token until staging copies it to host. If every staged request joined
as soon as its copy finished, the running hot buffers would leave too few
rows for the next prompt (a 16K prompt needs 16K rows while it prefills), so
the batch could never pass ``1 + (rows - prompt) / hot buffer``. A *parked*
request holds no device row: its whole KV is on host (staging put it there),
as after a PD-decode admission. It joins when its hot buffer fits beside
what the scheduler still has to prefill, so once the queue is prefilled the
batch grows to what the hot buffers allow.

What the scheduler still has to prefill comes from a :class:`PrefillDemand`
provider (``hooks.scheduler_get_next_batch_to_run`` installs one that reads
the waiting queue). Without a provider (PD decode, unit tests that do not
set one) nothing parks: a staged request joins as soon as its copy is done.

Mixed into :class:`sglang_hisparse.coordinator.HiSparseCoordinator`; uses
its ``_parked`` (slot -> request, oldest first), ``_free_prefill_rows``,
``_join_from_host`` and the allocator budgets.
Colocated DSA only (DeepSeek-V4's C4 rows keep the plain staging path).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional


class PrefillDemand(NamedTuple):
    """What the scheduler will ask of the device rows before more decoding."""

    in_flight_rows: int  # rows the chunked prefill in progress still needs
    next_tokens: int  # what admitting the next waiting request asks of available_size(); 0: none
    running: int  # requests in the running batch
    max_running: int  # the scheduler's max_running_requests


class ParkingMixin:
    def set_prefill_demand(self, provider: Optional[Callable[[], PrefillDemand]]) -> None:
        """Install the scheduler's view (None, or parking switched off: no parking)."""
        self._prefill_demand = provider if self.parking else None
        self.prefill_demand_installed = True

    def _demand(self) -> Optional[PrefillDemand]:
        provider = getattr(self, "_prefill_demand", None)
        if provider is None or self.is_dsv4_hisparse:
            return None
        return provider()

    def prefill_pending(self) -> bool:
        """Whether the scheduler has prompts to prefill (then a request past
        prefill is staged rather than kept resident: its rows are wanted)."""
        demand = self._demand()
        return demand is not None and (demand.in_flight_rows > 0 or demand.next_tokens > 0)

    def parked_requests(self) -> List[object]:
        """Parked requests, oldest first."""
        return list(self._parked.values())

    def _rows_to_keep_free(self, demand: PrefillDemand, logical: int) -> int:
        """``logical``: the allocator's logical budget (host space) now."""
        rows = demand.in_flight_rows
        # A waiting request that host space cannot admit now, or the device
        # could never hold while it prefills, gets no rows held back for it
        # (parked requests would wait for nothing).
        device = self.token_to_kv_pool_allocator.physical_size
        fits = demand.next_tokens + rows <= min(logical, device)
        if demand.next_tokens and fits:
            rows += demand.next_tokens
        return rows

    def _rows_after_joining(self, req, parked: bool, physical: int) -> int:
        """The physical budget (``physical`` now: free rows less those owed,
        plus what demotion frees) once ``req`` holds its hot buffer."""
        if parked:
            return physical - self.padded_buffer_size
        # A staged request turns its prefill rows into the hot buffer; a
        # short one's growth to a full buffer is already owed.
        held = self._page_up(req.fill_len)
        return physical + max(0, held - self.padded_buffer_size)

    def _may_join(self, req, demand: Optional[PrefillDemand], running: int, parked: bool) -> bool:
        """``running``: the batch size counting the requests joined so far."""
        if demand is None:
            return not parked
        if running >= demand.max_running:
            return False
        logical, physical = self.token_to_kv_pool_allocator.budgets()
        after = self._rows_after_joining(req, parked, physical)
        if req.to_finish is not None or running == 0:
            # An aborted request needs one step to finish; an empty batch does
            # not wait for a prompt (liveness: the prompt may never fit). The
            # prefill in flight keeps its rows either way.
            return after >= demand.in_flight_rows
        return after >= self._rows_to_keep_free(demand, logical)

    def _park(self, req) -> None:
        """Staging finished: free every device row of the request (its KV is on
        host) and let it wait outside the batch."""
        self._free_prefill_rows(req)
        req.hisparse_staging = True  # aborts and retracts treat it as staging
        self._parked[req.req_pool_idx] = req

    def _unpark(self, demand: Optional[PrefillDemand], running: int) -> List[object]:
        """Parked requests that may join now, oldest first (aborted ones first)."""
        if not self._parked:
            return []
        order = sorted(self._parked.values(), key=lambda r: r.to_finish is None)
        joined = []
        for req in order:
            if not self._may_join(req, demand, running, parked=True):
                if req.to_finish is None:
                    break  # keep arrival order among the rest
                continue
            self.token_to_kv_pool_allocator.make_rows_available(self.padded_buffer_size)
            del self._parked[req.req_pool_idx]
            self._join_from_host(req)
            joined.append(req)
            running += 1
        return joined

    def _drop_parked(self, req) -> None:
        if self._parked.get(req.req_pool_idx) is req:
            del self._parked[req.req_pool_idx]
