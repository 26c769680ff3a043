"""Parking: a staged request waits on host while prefills need the rows.

Why. A request that joins the decode batch takes a hot buffer (``B`` plus a
page of rows) until it finishes, and a prompt being prefilled holds one row
per token until staging copies it to host. If every staged request joined
as soon as its copy finished, the running hot buffers would leave too few
rows for the next prompt (a 16K prompt needs 16K rows while it prefills), so
the batch could never pass ``1 + (rows - prompt) / hot buffer``. A *parked*
request (state ``PARKED``) holds no device row: its whole KV is on host
(staging put it there), as after a PD-decode admission. It joins (-> ``HOT``)
when its hot buffer fits beside what the scheduler still has to prefill, so
once the queue is prefilled the batch grows to what the hot buffers allow.

What the scheduler still has to prefill comes from a :class:`PrefillDemand`
provider (``adapter.scheduler.scheduler_get_next_batch_to_run`` installs one
that reads the waiting queue). Without a provider (PD decode, unit tests
that do not set one) nothing parks for demand: a staged request joins as
soon as its copy is done. A staged request whose hot buffer finds no rows
(admission accounting drifted) is parked either way, and joins once rows
are free. Colocated DSA only (DeepSeek-V4's C4 rows keep the plain staging
path).

With streaming on (:mod:`.streaming`, ``SGLANG_HISPARSE_STREAMING=1``; off
by default) no rows are held back for a prompt that has not started
prefilling: a staged request parks only while the prefill in flight needs
its rows, and new prompts wait for parked requests instead. Parking's
prefill-ahead (the whole queue prefilled before parked requests join) is
the default.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

from sglang_hisparse.engine.state import ReqState

S = ReqState


class PrefillDemand(NamedTuple):
    """What the scheduler will ask of the device rows before more decoding."""

    in_flight_rows: int  # rows the chunked prefill in progress still needs
    next_tokens: int  # what admitting the next waiting request asks of available_size(); 0: none
    running: int  # requests in the running batch
    max_running: int  # the scheduler's max_running_requests


class Parking:
    def __init__(self, coord, enabled: bool):
        self.coord = coord
        self.enabled = enabled
        self._provider: Optional[Callable[[], PrefillDemand]] = None
        self.installed = False

    def set_prefill_demand(self, provider: Optional[Callable[[], PrefillDemand]]) -> None:
        """Install the scheduler's view (None, or parking switched off: no parking)."""
        self._provider = provider if self.enabled else None
        self.installed = True

    @property
    def provider(self) -> Optional[Callable[[], PrefillDemand]]:
        return self._provider

    def demand(self) -> Optional[PrefillDemand]:
        return None if self._provider is None else self._provider()

    def prefill_pending(self) -> bool:
        """Whether the scheduler has prompts to prefill (then a request past
        prefill is staged rather than kept resident: its rows are wanted)."""
        demand = self.demand()
        return demand is not None and (demand.in_flight_rows > 0 or demand.next_tokens > 0)

    # ---------------------------------------------------------- budget
    def _rows_to_keep_free(self, demand: PrefillDemand, logical: int) -> int:
        """``logical``: the allocator's logical budget (host space) now."""
        rows = demand.in_flight_rows
        if self.coord.streaming.enabled:
            # Streaming (policies/streaming.py): a prompt that has not started
            # waits for the requests that have streamed, not the other way round.
            return rows
        # A waiting request that host space cannot admit now, or the device
        # could never hold while it prefills, gets no rows held back for it
        # (parked requests would wait for nothing).
        device = self.coord.token_to_kv_pool_allocator.physical_size
        fits = demand.next_tokens + rows <= min(logical, device)
        if demand.next_tokens and fits:
            rows += demand.next_tokens
        return rows

    def _rows_after_joining(self, req, parked: bool, physical: int) -> int:
        """The physical budget (``physical`` now: free rows less those owed,
        plus what demotion frees) once ``req`` holds its hot buffer."""
        P = self.coord.padded_buffer_size
        if parked:
            return physical - P
        # A staged request turns its prefill rows into the hot buffer; a
        # short one's growth to a full buffer is already owed.
        held = self.coord._page_up(self.coord.prefill_len(req))
        return physical + max(0, held - P)

    def _may_join(self, req, demand: Optional[PrefillDemand], running: int, parked: bool) -> bool:
        """``running``: the batch size counting the requests joined so far."""
        if demand is None:
            if not parked:
                return True
            _, physical = self.coord.token_to_kv_pool_allocator.budgets()
            return self._rows_after_joining(req, parked, physical) >= 0
        if running >= demand.max_running:
            return False
        logical, physical = self.coord.token_to_kv_pool_allocator.budgets()
        after = self._rows_after_joining(req, parked, physical)
        if req.to_finish is not None or running == 0:
            # An aborted request needs one step to finish; an empty batch does
            # not wait for a prompt (liveness: the prompt may never fit). The
            # prefill in flight keeps its rows either way.
            return after >= demand.in_flight_rows
        return after >= self._rows_to_keep_free(demand, logical)

    # ----------------------------------------------------------- moves
    def admit(self, staged: List[object], running_extra: int) -> List[object]:
        """Requests whose staging copy finished: who joins now, who parks.
        Parked requests are considered first (they finished staging earlier).
        ``running_extra``: requests joining in this collect besides these."""
        coord = self.coord
        parked = coord.requests.count(S.PARKED)
        demand = self.demand() if (staged or parked) else None
        # The batch as it will be: the running requests plus those joining now.
        running = (demand.running if demand is not None else 0) + running_extra
        joined = self._unpark(demand, running) if parked else []
        running += len(joined)
        for req in staged:
            if self._may_join(req, demand, running, parked=False):
                if coord.join_staged(req):
                    joined.append(req)
                    running += 1
                    continue
                coord.note_drift(req, "no rows for its hot buffer; parked until rows are free")
            self.park(req)
        return joined

    def park(self, req) -> None:
        """STAGING -> PARKED: free every device row of the request (its KV is
        on host) and let it wait outside the batch."""
        self.coord.free_prefill_rows(req)
        self.coord.requests.move(req, S.PARKED)

    def _unpark(self, demand: Optional[PrefillDemand], running: int) -> List[object]:
        """Parked requests that may join now, oldest first (aborted ones first)."""
        coord = self.coord
        order = sorted(coord.requests.in_state(S.PARKED), key=lambda r: r.to_finish is None)
        joined = []
        for req in order:
            if not self._may_join(req, demand, running, parked=True):
                if req.to_finish is None:
                    break  # keep arrival order among the rest
                continue
            coord.token_to_kv_pool_allocator.make_rows_available(coord.padded_buffer_size)
            if not coord.join_from_host(req):
                break  # rows counted but not there: try again next collect
            joined.append(req)
            running += 1
        return joined
