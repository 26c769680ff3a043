"""One host pool buffer per node, shared by the local TP ranks (experimental).

DSA / MLA latent KV is the same on every TP rank (the latent projection is
replicated and its input is the all-reduced hidden state), yet each rank
pinning its own host pool makes a node pin TP times what it needs. With
``SGLANG_HISPARSE_SHARED_HOST_POOL=1`` the local ranks map one POSIX
shared-memory segment (a file in ``/dev/shm``) instead.

Lifecycle (:func:`open_shared_buffer`):

1. The local leader (local rank 0) creates the segment under a temporary
   name, sizes it and renames it to the agreed name, so no other rank can
   open it half-sized. It then leaves its attach marker.
2. Every other rank waits (polling, with a timeout and an error naming the
   segment) for the name to appear, checks its size against what it expects
   (a mismatch names both sizes), maps it and leaves its attach marker.
3. Whichever rank sees every local rank's marker first unlinks the segment
   and the markers. From then on nothing of it is in ``/dev/shm``: a rank
   that crashes later leaks nothing, and the memory lives until the last
   process unmaps it (shutdown frees it). A leader whose followers do not
   all attach within the timeout unlinks everything and raises, naming the
   ranks that never came.

Each mapping is ``MAP_SHARED``; where CUDA exists it is registered with
``cudaHostRegister`` (as the ``registered`` mode of
:mod:`sglang_hisparse.pools.host_memory`, whose :func:`release` unregisters
it), so the swap-in kernel reads it zero-copy; a CPU-only process gets the
plain mapped tensor.

Writers and readers. What this module guarantees: every rank maps the same
bytes, and a write of one is visible to the others once it completed.
What it relies on: host-row allocation decisions are identical on every TP
rank (issue #22 item 1: the same requests in the same states, allocation
from the same free lists; ``tests/test_tp_consistency.py``), so a host row
holds the same token on every rank.

Every rank still performs its own write-through into the shared rows: the
bytes are the same on every rank, and each rank's forward already waits for
its own pending write-through (``Streams.wait_for_pending_backup``), so
every rank's reads stay ordered after a complete write of the row exactly as
with a private pool. A single writer (only the leader writing, as vLLM does)
is not wired: a follower's decode step reads the previous token from host in
its first layer's swap-in (the newest token's slot was handed to the new
token), before any NCCL all-reduce of that step could order it after the
leader's write-through of that token. The all-reduces inside every TP
forward keep the ranks within one step of each other, which orders writes
of step s before reads of step s+1, but not within step s; a single writer
needs cross-process CUDA events (IPC handles) for that, which a CPU cannot
test. Limits of what is wired: it assumes the ranks' latent KV is bitwise
identical (true where the all-reduce hands every rank the same sum; if it
is not, a rank may read another rank's version of a row); PD transfers
would land once per rank into the same rows (refused in the arg rules);
none of it has run on a GPU yet.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
import uuid
from typing import Sequence

import torch

from sglang_hisparse.pools import host_memory

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "sglang_hisparse_"
DEFAULT_TIMEOUT_S = 120.0
_POLL_S = 0.02


class SharedHostPoolError(RuntimeError):
    """The local ranks could not agree on one shared host pool segment."""


def new_segment_name() -> str:
    """A name unique per server instance and node; the leader makes it and
    the adapter hands it to the other local ranks."""
    return f"{NAME_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"


def _marker(directory: str, name: str, local_rank: int) -> str:
    return os.path.join(directory, f"{name}.attached.{local_rank}")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_all(directory: str, name: str, local_ranks: int) -> None:
    _remove(os.path.join(directory, name))
    for rank in range(local_ranks):
        _remove(_marker(directory, name, rank))


def _all_attached(directory: str, name: str, local_ranks: int) -> bool:
    return all(os.path.exists(_marker(directory, name, r)) for r in range(local_ranks))


def _leave_marker(directory: str, name: str, local_rank: int) -> None:
    os.close(os.open(_marker(directory, name, local_rank), os.O_CREAT | os.O_WRONLY, 0o600))


def _create(path: str, nbytes: int) -> int:
    # Sized under a temporary name, then renamed: a follower never opens a
    # segment whose size is not final yet.
    tmp = f"{path}.creating"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        _remove(tmp)
        raise
    return fd


def _wait_and_open(path: str, nbytes: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise SharedHostPoolError(
                    f"shared HiSparse host pool {path}: the local leader (local TP rank 0) "
                    f"did not create it within {timeout_s:.0f} s (did it fail or die?)"
                ) from None
            time.sleep(_POLL_S)
    size = os.fstat(fd).st_size
    if size != nbytes:
        os.close(fd)
        raise SharedHostPoolError(
            f"shared HiSparse host pool {path}: this rank expects {nbytes} bytes but the "
            f"leader created {size} bytes; every local TP rank must size its host pool alike"
        )
    return fd


def _map(fd: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int], pin: bool):
    try:
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    # The tensor owns the mapping: it is unmapped when the tensor dies.
    t = host_memory._wrap(address, nbytes, region, dtype, shape)
    if pin and torch.cuda.is_available():
        host_memory._register(t, address, nbytes)
    return t


def open_shared_buffer(name: str, shape: Sequence[int], dtype: torch.dtype, *,
                       local_rank: int, local_ranks: int, pin: bool = True,
                       timeout_s: float = DEFAULT_TIMEOUT_S,
                       directory: str = SHM_DIR) -> torch.Tensor:
    """This rank's mapping of the node's shared host buffer ``name`` (see the
    module docstring for who creates, who waits and when it is unlinked)."""
    if not 0 <= local_rank < local_ranks:
        raise ValueError(f"local_rank {local_rank} is not in [0, {local_ranks})")
    if "/" in name or not name:
        raise ValueError(f"shared host pool name must be a plain file name, got {name!r}")
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        raise ValueError("a shared host pool of 0 bytes")
    path = os.path.join(directory, name)
    if local_rank == 0:
        fd = _create(path, nbytes)
    else:
        fd = _wait_and_open(path, nbytes, timeout_s)
    try:
        t = _map(fd, nbytes, dtype, shape, pin)
    except BaseException:
        if local_rank == 0:
            _unlink_all(directory, name, local_ranks)
        raise
    _leave_marker(directory, name, local_rank)
    if local_rank == 0:
        _wait_for_followers(directory, name, local_ranks, timeout_s)
    elif _all_attached(directory, name, local_ranks):
        _unlink_all(directory, name, local_ranks)
    logger.info("HiSparse shared host buffer %s: %.1f MiB, local rank %d of %d", name,
                nbytes / 2**20, local_rank, local_ranks)
    return t


def _wait_for_followers(directory: str, name: str, local_ranks: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _all_attached(directory, name, local_ranks):
        if not os.path.exists(os.path.join(directory, name)):
            return  # the last follower to attach unlinked it
        if time.monotonic() >= deadline:
            missing = [r for r in range(1, local_ranks)
                       if not os.path.exists(_marker(directory, name, r))]
            _unlink_all(directory, name, local_ranks)
            raise SharedHostPoolError(
                f"shared HiSparse host pool {os.path.join(directory, name)}: local rank(s) "
                f"{missing} did not attach within {timeout_s:.0f} s; the segment is unlinked")
        time.sleep(_POLL_S)
    _unlink_all(directory, name, local_ranks)


def leftovers(name_prefix: str = NAME_PREFIX, directory: str = SHM_DIR) -> list[str]:
    """Entries of ``directory`` a shared pool named with ``name_prefix`` left (tests, doctor)."""
    try:
        return sorted(e for e in os.listdir(directory) if e.startswith(name_prefix))
    except FileNotFoundError:
        return []

