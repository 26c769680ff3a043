"""``--hisparse-config``: the JSON object that sizes HiSparse, parsed and checked.

This module imports nothing from SGLang, so the rules can be tested (and
reused by tools) without paying for an SGLang import. The SGLang-facing side
lives in :mod:`sglang_hisparse.adapter.args`.

Keys (all optional)::

    top_k                 tokens the indexer selects per request and layer;
                          default: the model's ``index_topk``. An explicit
                          value must equal it (the indexer's top-k is fixed by
                          the weights, so any other value is a mistake).
    device_buffer_size    per-request hot buffer on the GPU, in tokens;
                          default 2 x top_k; must be in [top_k, 32767].
    host_to_device_ratio  host pool size as a multiple of the device KV pool;
                          default 2.
    swap_in_block_size    CUDA threads per block of the swap-in kernel;
                          default: the kernel's own choice (see
                          sglang_hisparse.kernels.default_block_size); a
                          multiple of 32 in [64, 1024].

The swap-in kernel's own limits (slots per thread, shared memory per block)
are checked when the config is resolved against the model, so a config the
kernel cannot run fails with the server arguments, not at the first decode
step.

0.5.13's own parser accepts anything json.loads accepts (unknown keys,
``true`` as a size, a buffer smaller than top_k with the model's top_k) and
only fails, if at all, once weights are loaded; here every mistake is a
:class:`HiSparseConfigError` that names the flag, the key and what is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable

from sglang_hisparse.kernels.limits import (  # torch-free
    MAX_BLOCK_SIZE as MAX_SWAP_IN_BLOCK_SIZE,
    MIN_BLOCK_SIZE as MIN_SWAP_IN_BLOCK_SIZE,
)

FLAG = "--hisparse-config"

DEFAULT_HOST_TO_DEVICE_RATIO = 2
# The kernel splits a block into 32-thread warps that copy items cooperatively,
# so a partial warp is not allowed; it needs two warps for its two scans, and
# 1024 is CUDA's limit on threads per block (see kernels/limits.py).
WARP_SIZE = 32


class HiSparseConfigError(ValueError):
    """A ``--hisparse-config`` value SGLang must not start with."""


@dataclass(frozen=True)
class HiSparseConfig:
    # None: not given; resolve() takes the model's index_topk.
    top_k: int | None = None
    # None: not given; resolve() makes it (draft tokens + 1) x top_k: 2 x top_k
    # for plain decoding.
    device_buffer_size: int | None = None
    host_to_device_ratio: int = DEFAULT_HOST_TO_DEVICE_RATIO
    # None: the kernel's DEFAULT_BLOCK_SIZE (measured, not guessed; kernels/limits.py).
    swap_in_block_size: int | None = None

    @property
    def is_resolved(self) -> bool:
        return self.top_k is not None and self.device_buffer_size is not None

    def resolve(self, model_index_topk: int | None, draft_tokens: int = 1) -> HiSparseConfig:
        """Fill ``top_k`` from the model and ``device_buffer_size`` from top_k.

        ``model_index_topk`` is the model config's ``index_topk`` (None for a
        model without one). ``draft_tokens`` is the tokens one speculative
        verify step checks (``--speculative-num-draft-tokens``; 1 without
        speculation): the swap-in resolves all their rows at once, so the
        buffer must hold ``draft_tokens x top_k`` and defaults to one top-k
        more than that (vLLM's choice too: room to keep hits of earlier
        steps). Raises HiSparseConfigError if an explicit top_k differs from
        the model's, or if neither gives a top_k.
        """
        top_k = self.top_k
        if model_index_topk is not None:
            if top_k is not None and top_k != model_index_topk:
                raise HiSparseConfigError(
                    f"{FLAG}: top_k is {top_k} but the model's index_topk is "
                    f"{model_index_topk}; the indexer always selects index_topk "
                    f"tokens, so omit top_k or set it to {model_index_topk}"
                )
            top_k = model_index_topk
        elif top_k is None:
            raise HiSparseConfigError(
                f"{FLAG}: the model config has no index_topk, so top_k must be "
                "given (a positive integer)"
            )
        device_buffer_size = (
            (draft_tokens + 1) * top_k if self.device_buffer_size is None
            else self.device_buffer_size
        )
        _check_buffer_holds_top_k(device_buffer_size, top_k)
        _check_swap_in_kernel_limits(top_k, device_buffer_size, self.swap_in_block_size,
                                     draft_tokens)
        return replace(self, top_k=top_k, device_buffer_size=device_buffer_size)


# key -> (description of allowed values, check returning True when allowed)
_KEYS: dict[str, tuple[str, Callable[[int], bool]]] = {
    "top_k": ("a positive integer equal to the model's index_topk", lambda v: v >= 1),
    "device_buffer_size": ("a positive integer >= top_k", lambda v: v >= 1),
    "host_to_device_ratio": ("a positive integer", lambda v: v >= 1),
    "swap_in_block_size": (
        f"a multiple of {WARP_SIZE} in [{MIN_SWAP_IN_BLOCK_SIZE}, {MAX_SWAP_IN_BLOCK_SIZE}]",
        lambda v: MIN_SWAP_IN_BLOCK_SIZE <= v <= MAX_SWAP_IN_BLOCK_SIZE and v % WARP_SIZE == 0,
    ),
}
KNOWN_KEYS: tuple[str, ...] = tuple(_KEYS)


def parse_hisparse_config(text: str | None) -> HiSparseConfig:
    """Parse the ``--hisparse-config`` value (None: flag not given -> defaults).

    The result is not resolved against a model yet; see HiSparseConfig.resolve.
    """
    if text is None:
        return HiSparseConfig()
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise HiSparseConfigError(
            f"{FLAG} is not valid JSON ({exc}); expected an object such as "
            '\'{"device_buffer_size": 4096}\''
        ) from exc
    if not isinstance(obj, dict):
        raise HiSparseConfigError(
            f"{FLAG} must be a JSON object with keys from {list(KNOWN_KEYS)}, "
            f"got {type(obj).__name__} {text!r}"
        )
    unknown = sorted(set(obj) - set(KNOWN_KEYS))
    if unknown:
        raise HiSparseConfigError(
            f"{FLAG}: unknown key(s) {unknown}; known keys are {list(KNOWN_KEYS)}"
        )
    for key, value in obj.items():
        allowed, is_allowed = _KEYS[key]
        # bool is a subclass of int, but `true` is never a size.
        if not isinstance(value, int) or isinstance(value, bool) or not is_allowed(value):
            raise HiSparseConfigError(
                f"{FLAG}: {key} must be {allowed}, got {json.dumps(value)}"
            )
    config = HiSparseConfig(**obj)
    if config.top_k is not None and config.device_buffer_size is not None:
        _check_buffer_holds_top_k(config.device_buffer_size, config.top_k)
    return config


def _check_buffer_holds_top_k(device_buffer_size: int, top_k: int) -> None:
    # The swap-in kernel places all top_k selected tokens in the hot buffer.
    if device_buffer_size < top_k:
        raise HiSparseConfigError(
            f"{FLAG}: device_buffer_size ({device_buffer_size}) must be >= "
            f"top_k ({top_k}), since every selected token is placed in the "
            "device buffer"
        )


def _check_swap_in_kernel_limits(top_k: int, device_buffer_size: int,
                                 swap_in_block_size: int | None, draft_tokens: int = 1) -> None:
    """What the swap-in kernel can run, named as this config names the sizes."""
    from sglang_hisparse.kernels.limits import size_problem

    problem = size_problem(top_k, device_buffer_size, swap_in_block_size,
                           draft_tokens=draft_tokens, hot_name="device_buffer_size",
                           block_name="swap_in_block_size")
    if problem:
        raise HiSparseConfigError(f"{FLAG}: {problem}")


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    # json.loads would silently keep the last of two equal keys.
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise HiSparseConfigError(f"{FLAG}: key {key!r} is given twice")
        seen[key] = value
    return seen


# Environment switches (documented in README). The modules that read them
# import these names; ENV_SWITCHES (name -> allowed values) is what
# validation checks before any weights load.
NATIVE_ENV = "SGLANG_HISPARSE_NATIVE"  # plugin: SGLang's own data plane + our fixes
SKIP_IO_ENV = "SGLANG_HISPARSE_SKIP_IO"  # coordinator: timing probe, no host copies
RESIDENCY_ENV = "SGLANG_HISPARSE_RESIDENCY"  # coordinator: "0" stages every request
PARKING_ENV = "SGLANG_HISPARSE_PARKING"  # coordinator: "0" joins staged requests at once
HOST_ALLOC_ENV = "SGLANG_HISPARSE_HOST_ALLOC"  # host_memory: how host pools are pinned
CHECK_ENV = "SGLANG_HISPARSE_CHECK"  # coordinator: "1" checks every swap-in's rows (debug)
# coordinator: benchmark-only synthetic top-k (kernels/synthetic_top_k.py);
# its values are a spec, checked by that module's parse, not a fixed list.
SYNTHETIC_TOPK_ENV = "SGLANG_HISPARSE_SYNTHETIC_TOPK"
# host pool (experimental, unproven on a GPU): "1" maps one shared-memory host
# pool per node for the local TP ranks instead of one pinned pool per rank
# (pools/shared_host_memory.py); the host-memory check then counts it once.
SHARED_HOST_POOL_ENV = "SGLANG_HISPARSE_SHARED_HOST_POOL"
# coordinator: "0" swaps every shared-index layer in synchronously instead of
# replaying its anchor's miss plan on the prefetch stream (A/B runs;
# engine/index_share.py).
INDEXSHARE_PREFETCH_ENV = "SGLANG_HISPARSE_INDEXSHARE_PREFETCH"
# coordinator: the grid of each IndexShare prefetch replay, BLOCKSxTHREADS
# (engine/prefetch.py: ReplayGrid says why it matters, its parse checks it).
PREFETCH_GRID_ENV = "SGLANG_HISPARSE_PREFETCH_GRID"
# coordinator: "1" (default) puts the IndexShare prefetch stream at the
# device's highest priority, so the block scheduler places a replay's blocks
# before the forward's queued ones instead of after them (engine/streams.py
# says why); "0" leaves it at the forward's.
PREFETCH_PRIORITY_ENV = "SGLANG_HISPARSE_PREFETCH_PRIORITY"
# coordinator: "0" (default) keeps streaming off (0.5.13's prefill-first
# order), "hold" keeps that order and sends a streamed first token with the
# second, "1" or a token cap turns the interleave on (with the hold)
# (engine/policies/streaming.py; its values are checked by that module's parse).
STREAMING_ENV = "SGLANG_HISPARSE_STREAMING"
HOST_ALLOC_MODES = ("cuda_host_alloc", "registered", "registered_thp")
ENV_SWITCHES = {
    NATIVE_ENV: ("0", "1"),
    SKIP_IO_ENV: ("0", "1"),
    RESIDENCY_ENV: ("0", "1"),
    PARKING_ENV: ("0", "1"),
    CHECK_ENV: ("0", "1"),
    SHARED_HOST_POOL_ENV: ("0", "1"),
    INDEXSHARE_PREFETCH_ENV: ("0", "1"),
    PREFETCH_PRIORITY_ENV: ("0", "1"),
    HOST_ALLOC_ENV: HOST_ALLOC_MODES,
}


def env_problems(environ) -> list[str]:
    """One line per HiSparse environment switch set to a value it does not take."""
    problems = []
    for name, allowed in ENV_SWITCHES.items():
        value = environ.get(name)
        if value is not None and value not in allowed:
            problems.append(f"{name}={value!r} is not valid; allowed: {', '.join(allowed)}")
    if environ.get(STREAMING_ENV) is not None:
        from sglang_hisparse.engine.policies.streaming import parse as parse_streaming

        try:
            parse_streaming(environ[STREAMING_ENV], STREAMING_ENV)
        except ValueError as exc:
            problems.append(str(exc))
    if environ.get(PREFETCH_GRID_ENV) is not None:
        from sglang_hisparse.engine.prefetch import ReplayGrid

        try:
            ReplayGrid.parse(environ[PREFETCH_GRID_ENV])
        except ValueError as exc:
            problems.append(str(exc))
    if environ.get(SYNTHETIC_TOPK_ENV):
        from sglang_hisparse.kernels.synthetic_top_k import parse

        try:
            parse(environ[SYNTHETIC_TOPK_ENV], SYNTHETIC_TOPK_ENV)
        except ValueError as exc:
            problems.append(str(exc))
    return problems
