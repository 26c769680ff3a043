"""Pinned host memory for the HiSparse host pools.

The swap-in kernel reads missed rows straight from host memory (zero-copy
loads through the GPU's mapping of it), one scattered 656-1152 B row at a
time. How that memory was pinned therefore decides how fast the link runs:
every row lands in a different page, and if the GPU maps the buffer with
small pages each read also walks the GPU page table.

Modes (``SGLANG_HISPARSE_HOST_ALLOC``):

``cuda_host_alloc``
    ``cudaHostAlloc`` (portable, mapped): the driver owns the memory and
    picks its page size. Freed by ``cudaFreeHost`` when the tensor dies.
``registered``
    What SGLang's HiCache does (``alloc_with_host_register``): ordinary
    pageable memory, then ``cudaHostRegister``. Released by
    :func:`release` (``cudaHostUnregister``).
``registered_thp``
    Like ``registered`` but the range is 2 MiB aligned and advised as
    transparent huge pages first, so the pages behind it are large.

CPU-only processes (tests, CI) get plain pageable tensors whatever the mode.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from typing import Optional, Sequence

import torch

from sglang_hisparse.config import HOST_ALLOC_ENV
from sglang_hisparse.config import HOST_ALLOC_MODES as MODES

logger = logging.getLogger(__name__)

DEFAULT_MODE = "cuda_host_alloc"

_HUGE_PAGE = 2 << 20
_CUDA_HOST_ALLOC_PORTABLE_MAPPED = 0x1 | 0x2


def configured_mode() -> str:
    mode = os.environ.get(HOST_ALLOC_ENV, DEFAULT_MODE)
    if mode not in MODES:
        raise ValueError(f"{HOST_ALLOC_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _cudart():
    """The CUDA runtime torch already loaded (dlopen by soname finds it)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libcudart is not loadable; set SGLANG_HISPARSE_HOST_ALLOC=registered")


def _check(rc: int, what: str) -> None:
    if int(rc) != 0:
        raise RuntimeError(f"{what} failed with CUDA error {int(rc)}")


def _wrap(ptr: int, nbytes: int, owner, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    t = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes)
    # The tensor keeps `raw` alive; `owner` must live exactly as long.
    raw._hisparse_owner = owner  # type: ignore[attr-defined]
    return t.view(dtype).view(*shape)


def _alloc_cuda_host(nbytes: int, dtype, shape) -> torch.Tensor:
    rt = _cudart()
    ptr = ctypes.c_void_p()
    _check(rt.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                            ctypes.c_uint(_CUDA_HOST_ALLOC_PORTABLE_MAPPED)), "cudaHostAlloc")
    address = ptr.value

    class _Owner:
        pass

    owner = _Owner()
    weakref.finalize(owner, _free_cuda_host, rt, address)
    return _wrap(address, nbytes, owner, dtype, shape)


def _free_cuda_host(rt, address: int) -> None:
    try:
        rt.cudaFreeHost(ctypes.c_void_p(address))
    except Exception:  # interpreter teardown: the context may be gone
        pass


def _alloc_registered(nbytes: int, dtype, shape, huge: bool) -> torch.Tensor:
    if huge:
        region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        offset = (-base) % _HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
        address = base + offset
        owner = region
    else:
        owner = torch.empty(nbytes, dtype=torch.uint8)
        address = owner.data_ptr()
    t = _wrap(address, nbytes, owner, dtype, shape)
    _register(t, address, nbytes)
    return t


def _register(t: torch.Tensor, address: int, nbytes: int) -> None:
    """Pin ``t`` (wrapping ``nbytes`` at ``address``) in place; :func:`release`
    unpins it. Also what a shared host pool's mapping gets
    (:mod:`sglang_hisparse.pools.shared_host_memory`)."""
    _check(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0), "cudaHostRegister")
    t._hisparse_registered = True  # type: ignore[attr-defined]


def alloc_pinned(shape: Sequence[int], dtype: torch.dtype, *, pin: bool = True,
                 mode: Optional[str] = None) -> torch.Tensor:
    """A zeroed-on-demand host tensor of ``shape``, pinned per ``mode``."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if not pin or not torch.cuda.is_available():
        return torch.empty(tuple(shape), dtype=dtype)
    mode = mode or configured_mode()
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if mode == "cuda_host_alloc":
        t = _alloc_cuda_host(nbytes, dtype, shape)
    else:
        t = _alloc_registered(nbytes, dtype, shape, huge=mode == "registered_thp")
    logger.info("HiSparse host buffer: %.1f MiB pinned (%s)", nbytes / 2**20, mode)
    return t


def release(t: torch.Tensor) -> None:
    """Unpin a buffer from :func:`alloc_pinned` (registered modes); the memory
    itself goes with the tensor. Idempotent."""
    if getattr(t, "_hisparse_registered", False) and torch.cuda.is_available():
        rc = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        if int(rc) != 0:
            logger.warning("cudaHostUnregister failed (rc=%d) for a HiSparse host buffer", int(rc))
        t._hisparse_registered = False  # type: ignore[attr-defined]
