"""What differs between the SGLang releases we pin, one module per release line.

The rest of the package is written once; where a pinned release names or
shapes something differently (a request field, a config dataclass, a hook
target's signature), the difference lives in one module here, and this
package picks it for the installed release in one place (:data:`current`).
A new pin that changes such a thing adds a module and a line to
``_FIRST_RELEASE``; nothing else tests the version.

Every module offers the same names:

* ``kv_allocated_len(req)`` / ``set_kv_allocated_len(req, n)`` - how many
  KV slots the request holds (0.5.17 moved the field into ``req.kv``);
* ``call_running_batch(scheduler, args, kwargs)`` - the running batch a
  ``Scheduler.get_next_batch_to_run`` / ``get_new_batch_prefill`` call works on;
* ``prefill_batch(result)``, ``no_prefill(running_batch)`` - the batch a
  ``get_new_batch_prefill`` call formed, what it returns when it forms none;
* ``init_pools_sized(original, configurator, args, kwargs, n)`` - the
  release's pool construction with the token pool sized ``n``;
* ``mla_kv_cache_dim(model_config, kv_cache_dtype, server_args)`` - the
  release's own MLA row width (elements);
* ``mla_host_pool_class()`` - SGLang's ``MLATokenToKVPoolHost`` (it moved in 0.5.17);
* ``jit_utils()``, ``jit_include_dirs()``, ``hisparse_ops()`` - SGLang's JIT
  kernel loader, the include directories it compiles with, its HiSparse
  kernel wrappers (``sglang.jit_kernel`` until 0.5.15, ``sglang.kernels`` from 0.5.17);
* ``prefill_len(req)`` - how far a request's prefill reached (its KV length
  once the prefill ran);
* ``set_prefill_range(req, start, end)`` - what the prefill scheduler records
  when it schedules ``[start, end)`` (the tests and the soak build requests
  through it);
* ``sparse_config(config)`` - SGLang's ``SparseConfig`` from our resolved config;
* ``native_max_token_pool_size(model_runner)`` - the release's own
  ``ModelRunner.max_token_pool_size`` (what ours falls back to);
* ``dsa_backend_defaults`` - the hook installed over the release's HiSparse
  DSA backend defaults (manifest entry ``apply_hisparse_dsa_backend_defaults``);
* ``speculative_v2_worker()`` - whether speculative decoding runs the V2
  (FutureMap) worker;
* ``speculative_seams_wired()`` - whether our verify-step seams exist for
  the release (linear MTP/EAGLE runs with HiSparse there, and is refused
  elsewhere);
* ``dsv4_kv_mode(pool)`` - how a ``DeepSeekV4TokenToKVPool`` lays out its
  KV: ``"paged"`` (separate paged SWA, C4 and C128 pools) or ``"unified"``
  (0.5.14's one buffer per layer with the SWA window as a per-request ring);
* ``decode_host_transfer_backends()`` - the ``--disaggregation-transfer-backend``
  values whose decode side can receive into HiSparse's host pool.
* ``override_server_args(server_args, source, fields)`` - change server
  arguments after their resolution, so that the checks read the new values
  (0.5.17's ``ServerArgs`` is read-only then: ``ServerArgs.override``);
* ``dsa_cell_accounting()`` - how the pool
  configurator charges a DSA token when it sizes the device pool
  (``arg_rules.dsa_device_token_bytes`` keywords; 0.5.17 counts the FP8
  scales and the HiSparse indexer at host_to_device_ratio);
* ``index_share_rules()`` - how the model code reads ``index_topk_pattern`` /
  ``index_topk_freq`` at their edges (``engine.index_share.RoleRules``).
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from sglang_hisparse import pins
from sglang_hisparse.pinned_source import sglang_version

# (the oldest release a module is written for, the module): a release uses
# the module of the newest entry at or before it.
_FIRST_RELEASE: tuple[tuple[str, str], ...] = (
    ("0.5.13", "sglang_0_5_13"),
    ("0.5.15.post1", "sglang_0_5_15"),
    ("0.5.17", "sglang_0_5_17"),
)


def module_for(version: str) -> ModuleType:
    """The release module for ``version`` (ValueError before the oldest)."""
    key = pins.version_key(version)
    chosen = [name for first, name in _FIRST_RELEASE if pins.version_key(first) <= key]
    if not chosen:
        raise ValueError(f"sglang {version} predates every release module "
                         f"(oldest: {_FIRST_RELEASE[0][0]})")
    return import_module(f"{__name__}.{chosen[-1]}")


# The installed release's module: the one place that reads the version.
current: ModuleType = module_for(sglang_version())


def speculative_releases() -> tuple[str, ...]:
    """The supported releases whose module wires the verify step (what the
    refusal of MTP elsewhere names)."""
    return tuple(v for v in pins.supported_versions() if module_for(v).speculative_seams_wired())


# The manifest's impl for the DSA backend defaults: the installed release's
# hook itself (its target's signature differs per release).
dsa_backend_defaults = current.dsa_backend_defaults
