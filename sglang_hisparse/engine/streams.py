"""The streams HiSparse's copies run on, and the order rules between them.

Three streams (four with IndexShare) touch the KV of a request besides SGLang's forward stream:

* **staging** (``Streams.staging``): the copy of a finished prefill to host.
  It starts after an event recorded on the scheduler's current stream when
  the request is admitted (the prefill's writes are ordered before it), and
  ends with an event ``collect_ready_reqs`` polls; the request's prefill rows
  are not reused before that event has fired.
* **write-through** (``Streams.backup``): each decode step copies the
  previous token of every hot-buffer request to host. It waits for the
  scheduler's current stream and for SGLang's decode producer stream (the
  forward that wrote that token may still run there, with the overlap
  scheduler), and records an event; the next forward waits for that event
  (``wait_for_pending_backup``, which 0.5.13's ``ModelRunner`` calls before
  the forward), so a host row is complete before any swap-in reads it.
* **forward** (SGLang's): swap-in and attention; the in-server exactness
  check runs here right after each swap-in.
* **prefetch** (``Streams.prefetch``; IndexShare models only,
  :mod:`.prefetch`): right after an anchor layer's swap-in it waits for an
  event recorded on the forward stream and replays the anchor's miss plan on
  each shared layer's pools, recording one event per shared layer; that
  layer's attention waits for its event. Every replay is waited for within
  the same forward (so a CUDA graph's side stream is joined), and the next
  anchor's swap-in, which overwrites the plan, also waits for any left.
  By default (``SGLANG_HISPARSE_PREFETCH_PRIORITY`` unset or ``1``) the
  stream has a higher priority than the forward's (which runs at the
  default, the lowest; ``0`` puts the prefetch there too): the
  block scheduler then places a replay's blocks on the next SM that frees up
  instead of behind every block the forward has queued, so a small replay
  grid moves its rows while the forward's GEMMs fill the other SMs. PyTorch
  instantiates CUDA graphs with per-node priorities, and a kernel captured on
  this stream keeps its priority in the graph.

Releasing rows (finish, abort, retract) and demoting a resident first make
the current stream wait for the decode producer stream and for the pending
write-through, so a row is never freed or overwritten while a copy or the
in-flight step still uses it. On the CPU (tests) every copy is synchronous
and the events are :class:`CpuEvent`.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def device_index(values, device) -> torch.Tensor:
    """CPU ints (a sequence or a CPU tensor) as an int64 index tensor on
    ``device``, without a stream sync.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and
    then synchronizes the current stream: the CPU waits until the GPU has run
    everything queued, so a step prepared that way no longer overlaps the one
    in flight (MTP on 2026-12-03: two such calls per verify step). A
    non-blocking copy from pageable memory is no better: the driver may
    synchronize with the stream to stage it. From pinned memory the copy is
    queued in stream order instead, and PyTorch's pinned allocator keeps the
    staging memory until that copy has run."""
    if torch.device(device).type != "cuda":
        return torch.as_tensor(values, dtype=torch.int64).to(device)
    if isinstance(values, torch.Tensor):
        staged = values.to(torch.int64).pin_memory()
    else:
        staged = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return staged.to(device, non_blocking=True)


def fill_at(tensor: torch.Tensor, index, value: int) -> None:
    """``tensor[index] = value`` for a 1-D ``tensor`` and an index tensor
    (positions or a mask) or an int, without a stream sync.

    For a CUDA tensor, ``t[idx] = 0`` wraps the 0 in a CPU tensor and copies
    it to the device from pageable memory, which synchronizes the stream
    (measured 2026-12-04-s2: the verify commit's unmapping was the one sync
    per MTP step that base's step does not make; ``t[i] = 0`` for an int
    synced too, as a 0-d copy). ``index_fill_``, ``masked_fill_`` and a
    slice's ``fill_`` take the value as a kernel argument instead."""
    if not isinstance(index, torch.Tensor):  # one position (an int, numpy's too)
        i = int(index)
        tensor[i:i + 1].fill_(value)
        return
    index = index.reshape(-1)
    if index.dtype == torch.bool:
        tensor.masked_fill_(index.to(tensor.device), value)
        return
    if index.device != tensor.device:  # moved as the assignment would, but staged
        index = device_index(index, tensor.device)
    tensor.index_fill_(0, index.to(torch.int64), value)


class CpuEvent:
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


class Streams:
    """Side streams and events on CUDA; synchronous no-ops elsewhere."""

    # The prefetch stream's priority when raised: any value below the
    # default 0 is a higher priority than the forward's.
    HIGH_PRIORITY = -1

    def __init__(self, device, prefetch_high_priority: bool = False):
        self.gpu = str(device).startswith("cuda") and torch.cuda.is_available()
        self.cpu_event_delay: Callable[[], int] = lambda: 0
        self.staging = torch.cuda.Stream() if self.gpu else None
        self.backup = torch.cuda.Stream() if self.gpu else None
        self.prefetch_priority = self.HIGH_PRIORITY if prefetch_high_priority else 0
        self.prefetch = torch.cuda.Stream(priority=self.prefetch_priority) if self.gpu else None
        # SGLang's stream that runs the decode forward (overlap scheduler);
        # None: the current stream.
        self.decode_producer = None
        self._backup_done = None  # event of the last write-through

    def event(self):
        return torch.cuda.Event() if self.gpu else CpuEvent(self.cpu_event_delay())

    def use(self, stream):
        return torch.cuda.stream(stream) if self.gpu else contextlib.nullcontext()

    def after_decode_producer(self) -> None:
        """Order the current stream after the in-flight decode step."""
        if self.gpu and self.decode_producer is not None:
            torch.cuda.current_stream().wait_stream(self.decode_producer)

    def begin_write_through(self):
        """Context for a write-through copy on the backup stream (CUDA), in
        order after the current and decode producer streams."""
        if not self.gpu:
            return contextlib.nullcontext()
        cur = torch.cuda.current_stream()
        ctx = torch.cuda.stream(self.backup)
        self.backup.wait_stream(cur)
        if self.decode_producer is not None:
            self.backup.wait_stream(self.decode_producer)
        return ctx

    def end_write_through(self, *tensors) -> None:
        """Call inside :meth:`begin_write_through`: record the completion event."""
        if not self.gpu:
            return
        self._backup_done = torch.cuda.Event()
        self._backup_done.record()
        for t in tensors:
            t.record_stream(self.backup)

    def wait_for_pending_backup(self) -> None:
        """Make the current stream wait for the last write-through."""
        if self._backup_done is not None:
            self._backup_done.wait(torch.cuda.current_stream())
            self._backup_done = None

    def before_release(self) -> None:
        """Rows may be freed once nothing in flight reads or writes them."""
        if self.gpu:
            self.after_decode_producer()
            self.wait_for_pending_backup()

    def synchronize(self) -> None:
        if self.gpu:
            self.staging.synchronize()
            self.backup.synchronize()
            self.prefetch.synchronize()


class TrailingReader:
    """Reads a small device tensor of counters without waiting on the GPU
    (as a flat list).

    Each :meth:`read` starts a copy to pinned memory and returns what the
    last finished copy saw, so on a GPU the values trail by one reading (one
    decode log interval). A sync here would stall the scheduler and cost the
    decode step it overlaps with. On the CPU it reads the tensor itself.
    """

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._host = torch.zeros_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
        self._copy = None  # event of the copy in flight
        self._seen = [0] * tensor.numel()

    def read(self) -> list:
        if not self.tensor.is_cuda:
            return self.tensor.view(-1).tolist()
        if self._copy is not None and self._copy.query():
            self._seen = self._host.view(-1).tolist()
            self._copy = None
        if self._copy is None:
            self._host.copy_(self.tensor, non_blocking=True)
            self._copy = torch.cuda.Event()
            self._copy.record()
        return list(self._seen)

    def reset(self) -> None:
        """Zero the counters (in stream order) and forget readings in flight."""
        self.tensor.zero_()
        self._copy, self._seen = None, [0] * self.tensor.numel()


class RealRequestCount:
    """The int32 [1] device scalar the swap-in kernel reads as the number of
    real (not CUDA-graph padding) rows, behind SGLang's ``num_real_reqs.fill_(n)``.

    SGLang 0.5.13 fills it twice per decode step (``ModelRunner.forward`` and
    the graph runner's ``replay_prepare``, one after the other on the forward
    stream), almost always with the value it already holds; each fill is a
    kernel launch on the scheduler's critical path. Only this object writes
    the tensor, so a fill that would not change it is skipped. (A behaviour
    change from 0.5.13, where ``num_real_reqs`` is the tensor itself: ours is
    this object; SGLang only calls ``fill_`` on it, a DEPENDS entry each.)
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
