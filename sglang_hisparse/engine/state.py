"""Where each request is in HiSparse's lifecycle, as one explicit state.

Every request the coordinator holds has exactly one :class:`ReqState`,
kept in a :class:`RequestTable` keyed by its ``req_pool_idx`` slot. Every
move between states goes through :meth:`RequestTable.move`, which checks it
against :data:`TRANSITIONS`; a move not listed there is a bug and raises
:class:`IllegalTransition` naming the request and both states. Nothing else
decides a request's state (no container membership, no flag, no buffer
size), so a new feature (MTP verification, PD transfer states) adds states
and transitions here and a policy that drives them.

Lifecycle (colocated, DSA)::

    prefill done --> RESIDENT_JOINING --collect--> RESIDENT
          |                |  demote                  | demote
          |                v                          v
          |           HOT_JOINING ---collect------>  HOT  <--+
          |                                           ^      |
          +--> HOST_WAIT --pages--> STAGING --copied--+      |
                                       |  no rows yet        |
                                       +--> PARKED --join----+

PD decode holds a request from its prealloc on: TRANSFERRING while the
prefill node writes its KV into the host rows the prealloc gave it (or,
resuming, while it takes back the rows it kept on host when it was
retracted), then HOT once it is admitted (its KV is all on host). Any state
ends by release (finish, abort, retract, a failed transfer), which removes
the record.

``req.hisparse_staging`` is SGLang's own attribute on ``Req`` (0.5.13 only
initialises it); the table keeps it equal to :attr:`ReqState.outside_batch`
for code and tests that read it.
"""

from __future__ import annotations

import enum
from typing import Dict, Iterator, List, Optional, Tuple


class ReqState(enum.Enum):
    # Holds its prefill rows; waits for host pages to start the copy.
    HOST_WAIT = "host_wait"
    # Holds its prefill rows; the copy to host is in flight.
    STAGING = "staging"
    # Its whole KV is on host (staged); holds no device row; waits to join
    # the batch until its hot buffer fits beside the pending prefills.
    PARKED = "parked"
    # Keeps its whole KV on the GPU; joins the batch at the next collect.
    RESIDENT_JOINING = "resident_joining"
    # Demoted to a hot buffer before it joined; joins at the next collect.
    HOT_JOINING = "hot_joining"
    # Decoding with its whole KV on the GPU (no host IO, no swap-in work).
    RESIDENT = "resident"
    # Decoding from a hot buffer; the authoritative KV is on host.
    HOT = "hot"
    # PD decode: holds the host rows its prealloc took (the transfer's
    # destination, or the rows it kept when retracted) and no device row;
    # admitted as HOT once its KV is there.
    TRANSFERRING = "transferring"

    # Members are singletons, compared by identity: hash them by identity too,
    # in C (Enum's own __hash__ is Python code, and the table hashes a state
    # on every count the scheduler's per-step calls make).
    __hash__ = object.__hash__

    @property
    def outside_batch(self) -> bool:
        """Past prefill but not in the running batch (what ``staged_requests``
        lists, and what an abort must mark so it still finishes)."""
        return self in _OUTSIDE_BATCH

    @property
    def is_resident(self) -> bool:
        return self in (ReqState.RESIDENT, ReqState.RESIDENT_JOINING)


_OUTSIDE_BATCH = frozenset(
    (ReqState.HOST_WAIT, ReqState.STAGING, ReqState.PARKED, ReqState.RESIDENT_JOINING)
)

# None stands for "not held by the coordinator" (before admission, after release).
_S = ReqState
TRANSITIONS: Dict[Optional[ReqState], frozenset] = {
    None: frozenset((_S.HOST_WAIT, _S.STAGING, _S.RESIDENT_JOINING, _S.HOT, _S.TRANSFERRING)),
    _S.TRANSFERRING: frozenset((_S.HOT, None)),
    _S.HOST_WAIT: frozenset((_S.STAGING, None)),
    _S.STAGING: frozenset((_S.HOT, _S.PARKED, None)),
    _S.PARKED: frozenset((_S.HOT, None)),
    _S.RESIDENT_JOINING: frozenset((_S.RESIDENT, _S.HOT_JOINING, None)),
    _S.HOT_JOINING: frozenset((_S.HOT, None)),
    _S.RESIDENT: frozenset((_S.HOT, None)),
    _S.HOT: frozenset((None,)),
}


class IllegalTransition(RuntimeError):
    """A state change :data:`TRANSITIONS` does not allow (a coordinator bug)."""


class RequestRecord:
    """One request's entry: its state plus the per-request facts that belong
    to the lifecycle rather than to the device tables."""

    __slots__ = ("req", "state", "resident_rows", "skip_first_backup", "prefill_done_at")

    def __init__(self, req, state: ReqState):
        self.req = req
        self.state = state
        # Rows a resident holds (whole pages of its KV); 0 otherwise.
        self.resident_rows = 0
        # The next decode step must not write the previous token through:
        # the staging copy, a demotion or a host preload already put it there.
        self.skip_first_backup = False
        # When its prefill ended (it had streamed its first token), until it
        # joins the running batch: the coordinator's clock, or None.
        self.prefill_done_at: Optional[float] = None


class RequestTable:
    """Every request the coordinator holds, by ``req_pool_idx``, with its state.

    Iteration order is admission order; :meth:`in_state` lists a state's
    requests in the order they entered it (parking joins oldest first).
    """

    def __init__(self):
        self._records: Dict[int, RequestRecord] = {}
        # state -> {idx: None}, insertion-ordered: who entered the state when.
        self._by_state: Dict[ReqState, Dict[int, None]] = {s: {} for s in ReqState}
        # The per-step paths look records up by slot: the dict's own get,
        # without a Python-level method call in between.
        self.record = self._records.get

    # ---------------------------------------------------------------- reads
    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, idx: int) -> bool:
        return idx in self._records

    def holds(self, req) -> bool:
        """Whether this very request object is held (a slot may be reused)."""
        rec = self._records.get(req.req_pool_idx)
        return rec is not None and rec.req is req

    def state_of(self, req) -> Optional[ReqState]:
        rec = self._records.get(req.req_pool_idx)
        return rec.state if rec is not None and rec.req is req else None

    def records(self) -> Iterator[Tuple[int, RequestRecord]]:
        return iter(self._records.items())

    def count(self, state: ReqState) -> int:
        return len(self._by_state[state])

    def in_state(self, *states: ReqState) -> List[object]:
        """Requests in any of ``states``, each state's in the order it was entered."""
        return [self._records[i].req for s in states for i in self._by_state[s]]

    def slots_in(self, state: ReqState) -> List[int]:
        return list(self._by_state[state])

    def slots(self) -> List[int]:
        return sorted(self._records)

    # ---------------------------------------------------------------- moves
    def admit(self, req, state: ReqState) -> RequestRecord:
        idx = req.req_pool_idx
        old = self._records.get(idx)
        if old is not None:
            raise IllegalTransition(
                f"HiSparse: slot {idx} admits {req.rid} while it still holds "
                f"{old.req.rid} ({old.state.value})")
        _check(req, None, state)
        rec = RequestRecord(req, state)
        self._records[idx] = rec
        self._by_state[state][idx] = None
        req.hisparse_staging = state.outside_batch
        return rec

    def move(self, req, to: ReqState) -> RequestRecord:
        idx = req.req_pool_idx
        rec = self._records.get(idx)
        if rec is None or rec.req is not req:
            raise IllegalTransition(f"HiSparse: {req.rid} moves to {to.value} but is not held")
        _check(req, rec.state, to)
        del self._by_state[rec.state][idx]
        self._by_state[to][idx] = None
        rec.state = to
        if not to.is_resident:
            rec.resident_rows = 0
        req.hisparse_staging = to.outside_batch
        return rec

    def release(self, req) -> Optional[RequestRecord]:
        """Drop the request (any state); None if this request is not held."""
        idx = req.req_pool_idx
        rec = self._records.get(idx)
        if rec is None or rec.req is not req:
            return None
        del self._by_state[rec.state][idx]
        del self._records[idx]
        req.hisparse_staging = False
        return rec

    def clear(self) -> None:
        for rec in self._records.values():
            rec.req.hisparse_staging = False
        self._records.clear()
        for members in self._by_state.values():
            members.clear()


def _check(req, frm: Optional[ReqState], to: Optional[ReqState]) -> None:
    if to not in TRANSITIONS[frm]:
        name = lambda s: "released" if s is None else s.value  # noqa: E731
        raise IllegalTransition(
            f"HiSparse: {getattr(req, 'rid', req)} cannot go from {name(frm)} to {name(to)}")
