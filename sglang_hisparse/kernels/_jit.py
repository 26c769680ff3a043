"""Building the ``jit_csrc/`` kernels through SGLang's JIT loader (tvm-ffi).

Shared by every kernel family: where CUDA lives, the loader itself (imported
at the first build, so importing a wrapper does not import SGLang), the
target architecture when no GPU is visible, readable variant names, the
module cache and the device facts the launch geometry needs.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import shutil
from pathlib import Path

import torch

CSRC_DIR = Path(__file__).resolve().parent.parent / "jit_csrc"


def _cuda_home_candidates() -> list[Path]:
    found = [Path("/usr/local/cuda")] + [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.insert(0, Path(nvcc).resolve().parent.parent)
    return found


def _ensure_cuda_home() -> None:
    """tvm-ffi derives the CUDA root from `which nvcc` when CUDA_HOME is unset,
    which breaks when nvcc on PATH is a wrapper script (no lib64 next to it)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for home in _cuda_home_candidates():
        if (home / "bin" / "nvcc").exists() and (home / "lib64").exists():
            os.environ["CUDA_HOME"] = str(home)
            return


def nvcc_available() -> bool:
    if shutil.which("nvcc"):
        return True
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    homes = [Path(home)] if home else _cuda_home_candidates()
    return any((h / "bin" / "nvcc").exists() for h in homes)


def arch_context():
    """Without a visible GPU, build for Hopper (sm_90a), the production target."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from sglang_hisparse.adapter import releases

    return releases.current.jit_utils().override_jit_cuda_arch(9, 0, "a")


@functools.cache
def load_module(name: str, source: str, export: str, cpp_class: str, template_args: tuple):
    """One compiled variant: ``cpp_class<template_args...>::run`` of the
    header ``source`` (a file name in jit_csrc/), exported as ``export``.
    Built once per process (and found in tvm-ffi's disk cache after that)."""
    _ensure_cuda_home()
    from sglang_hisparse.adapter import releases

    jit = releases.current.jit_utils()
    args = jit.make_cpp_args(*template_args)
    return jit.load_jit(
        name,
        *args,
        cuda_files=[str(CSRC_DIR / source)],
        cuda_wrappers=[(export, f"{cpp_class}<{args}>::run")],
    )


def variant_name(kind: str, **kw) -> str:
    return kind + "(" + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")"


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
