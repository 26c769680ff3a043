"""Every place where sglang-hisparse touches or leans on SGLang, as data.

Each :class:`Entry` says what is changed or relied on (``target``), how
(``kind``), which exact source it was written against (``sha256`` per SGLang
release, read from the pins: ``patches/sglang-<version>/pin.json``, written
by ``scripts/rebase.py --write``, see :mod:`sglang_hisparse.pins`), why, which SGLang process runs the target (``process``), and when
upstream made it unnecessary (``native_in``). The loader refuses to activate
anything unless every entry checks out against the installed SGLang;
``python -m sglang_hisparse doctor`` prints the same checks. A pin upgrade is a
rebase of this list: ``scripts/rebase.py`` re-hashes the targets on the new
release, re-applies the source patches and reports what needs a human.

Kinds:
  BEFORE / AFTER / AROUND / REPLACE  SGLang ``HookRegistry`` hooks (``impl``
                                     is ``module:attr`` of our callable/class).
  PROPERTY                           a ``@property`` getter replaced on its class
                                     (HookRegistry cannot wrap properties).
  SOURCE_PATCH                       a unified diff under
                                     ``patches/sglang-<version>/<target>.diff``
                                     applied to the target's source in memory,
                                     compiled in the target's module and installed
                                     as a REPLACE (code a hook cannot reach).
  DEPENDS                            hash only, nothing is installed: an SGLang
                                     function that calls into our code (the
                                     coordinator's, allocator's and pools' call
                                     sites) or whose logic our code mirrors
                                     (PrefillAdder's costing, ``_pre_alloc``'s
                                     fill length, ``release_req``'s order).
                                     ``relied_on_by`` names our code that a
                                     person must re-read when it changes. A
                                     target already hashed by a hook entry (e.g.
                                     ``Scheduler.get_next_batch_to_run``) gets
                                     no DEPENDS entry: a target is listed once per
                                     release (a patch ``until`` a release and a
                                     DEPENDS ``since`` the next may share one).

Every entry is checked the same way (all or nothing at activation; a changed
DEPENDS target refuses activation on that release exactly like a changed
hook target).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sglang_hisparse import pins


class Kind(str, enum.Enum):
    BEFORE = "BEFORE"
    AFTER = "AFTER"
    AROUND = "AROUND"
    REPLACE = "REPLACE"
    PROPERTY = "PROPERTY"
    SOURCE_PATCH = "SOURCE_PATCH"
    DEPENDS = "DEPENDS"

    @property
    def installs(self) -> bool:
        """Whether the loader installs something for this kind (DEPENDS: hash only)."""
        return self is not Kind.DEPENDS


class Scope(str, enum.Enum):
    # Always applied: argument handling and fixes that SGLang's own HiSparse
    # also needs (they keep the "native" comparison mode usable).
    ALWAYS = "always"
    # Our data plane (coordinator, allocator, pools, kernels). Skipped when
    # SGLANG_HISPARSE_NATIVE=1 asks for SGLang's own HiSparse with fixes only.
    DATA_PLANE = "data_plane"
    # Only in that comparison mode: what lets SGLang's own data plane be
    # measured like ours (never installed beside our data plane).
    NATIVE = "native"


class Process(str, enum.Enum):
    """Which SGLang process runs the target (``load_plugins()`` installs every
    hook in both, so this says where an entry's effect is, and whose log shows
    its errors)."""

    # The process that parses the arguments and starts the rest
    # (``python -m sglang.launch_server``, or the caller of ``sglang.Engine``):
    # ServerArgs.__post_init__ and check_server_args run only here (scheduler
    # processes receive the checked ServerArgs pickled).
    LAUNCHER = "launcher"
    # Every scheduler subprocess (one per TP/PP rank): model runner, pools,
    # coordinator, scheduler loop, attention backends.
    SCHEDULER = "scheduler"
    # Both: only SGLang's plugin loading, which installs this manifest in the
    # launcher and again first thing in every scheduler subprocess. No hook
    # target runs in both (checked against 0.5.13's callers).
    BOTH = "both"


@dataclass(frozen=True)
class Entry:
    target: str
    kind: Kind
    # SGLang version -> sha256 of the target's source; None (the manifest's
    # own entries): from the pins (sglang_hisparse.pins.hashes).
    sha256: dict[str, str] | None
    why: str  # hooks: why we change it; DEPENDS: what we rely on (one line)
    native_in: str | None  # upstream release where the behaviour became native
    process: Process
    impl: str | None = None  # "module:attr" of our hook; None for SOURCE_PATCH / DEPENDS
    upstream: str = ""  # where upstream did it (release file:line, PR)
    scope: Scope = Scope.ALWAYS
    removal: str = ""  # what to do with this entry once the pin passes native_in
    # REPLACE (and SOURCE_PATCH): one line per behaviour that differs from the
    # target it replaces, as a user or an SGLang caller would notice it.
    behaviour: tuple[str, ...] = ()
    # DEPENDS: our code ("module:qualname") that mirrors or is called by the target.
    relied_on_by: tuple[str, ...] = ()
    # Test modules (paths from the repository root) that cover the entry; for
    # DEPENDS, those that run the target or our mirror of it (the hash itself
    # is checked by tests/test_manifest.py).
    tests: tuple[str, ...] = ()
    # The first pinned release whose source has the target (None: all of
    # them). Pins of earlier releases do not hash it and nothing checks it
    # there: a seam a later release added (0.5.15's Scheduler.release_host_resources).
    since: str | None = None
    # The last pinned release whose source has the target (None: every one
    # from ``since`` on); later pins do not hash it: a seam a release
    # reshaped, which that release's own entry takes over.
    until: str | None = None

    def __post_init__(self):
        if self.sha256 is None:
            # Only the releases this entry covers: a target listed again
            # over other releases has the rest.
            object.__setattr__(self, "sha256", {v: h for v, h in pins.hashes(self.target).items()
                                                if self.applies_to(v)})

    @property
    def name(self) -> str:
        return self.target.removeprefix("sglang.srt.")

    def applies_to(self, version: str) -> bool:
        """Whether the release ``version`` has this entry's target."""
        key = pins.version_key(version)
        return ((self.since is None or key >= pins.version_key(self.since))
                and (self.until is None or key <= pins.version_key(self.until)))

    @property
    def releases(self) -> str:
        """The releases it applies to, for messages ("from 0.5.15.post1")."""
        return " ".join(filter(None, (self.since and f"from {self.since}",
                                      self.until and f"up to {self.until}"))) or "all"


_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_HISPARSE_HOOK = "sglang.srt.arg_groups.hisparse_hook"
_FACTORY = "sglang.srt.mem_cache.sparsity.factory"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_KV_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
_KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_GRAPH = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner"
_BATCH_MOD = "sglang.srt.managers.schedule_batch"
_BATCH = f"{_BATCH_MOD}.ScheduleBatch"
_REQ = f"{_BATCH_MOD}.Req"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_BRP = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor"
)
_POOL_STATS = (
    "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver"
)
_COMMON = "sglang.srt.mem_cache.common"
_DECODE = "sglang.srt.disaggregation.decode"
_PREALLOC = f"{_DECODE}.DecodePreallocQueue"
_DECODE_MIXIN = f"{_DECODE}.SchedulerDisaggregationDecodeMixin"
_DSA = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
_DISAGG_UTILS = "sglang.srt.disaggregation.utils"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

_CONN = "sglang.srt.disaggregation"

# Our side, as named in relied_on_by.
_HOST_BACKENDS_0_5_13 = (
    "sglang_hisparse.adapter.releases.sglang_0_5_13:decode_host_transfer_backends")
_HOST_BACKENDS_0_5_15 = (
    "sglang_hisparse.adapter.releases.sglang_0_5_15:decode_host_transfer_backends")
_COORD = "sglang_hisparse.adapter.model_runner:HiSparseCoordinator"
_ALLOC = "sglang_hisparse.pools.allocator:HiSparseDualAllocator"
_RETAIN = "sglang_hisparse.engine.policies.retain_on_retract:RetainOnRetract"
_DEMAND = "sglang_hisparse.adapter.scheduler:scheduler_prefill_demand"
_STREAMING_HOOK = "sglang_hisparse.adapter.scheduler:scheduler_get_new_batch_prefill"
_GROWTH_ON_HOST = "sglang_hisparse.adapter.prefill_adder:adder_init_growth_on_host"
_IGNORE_EOS_HOOK = "sglang_hisparse.adapter.prefill_adder:adder_add_one_req_ignore_eos"
_ADD_ONE_REQ_HOOK = "sglang_hisparse.adapter.prefill_adder:adder_add_one_req"
_DECODE_CHECK_HOOK = "sglang_hisparse.adapter.prefill_adder:batch_check_decode_mem"
_COUNT = "sglang_hisparse.engine.streams:RealRequestCount"
_DRAFT_SWA = "sglang_hisparse.adapter.disaggregation_dsv4:register_draft_swa_state"
_ROLES = "sglang_hisparse.engine.index_share:roles_from_config"
_ROLE_RULES_0_5_13 = "sglang_hisparse.adapter.releases.sglang_0_5_13:index_share_rules"
_ROLE_RULES_0_5_15 = "sglang_hisparse.adapter.releases.sglang_0_5_15:index_share_rules"
_PREFETCH = "sglang_hisparse.engine.prefetch:IndexSharePrefetch"

def _data_plane_hook(**fields) -> Entry:
    """Most hooks: our data plane's, installed in the scheduler processes and
    kept while the data plane is ours (the fields each such entry shares;
    the hashes come from the pins)."""
    return Entry(sha256=None, native_in=None, scope=Scope.DATA_PLANE,
                 process=Process.SCHEDULER, removal="keep while the data plane is ours",
                 **fields)


# Everything the loader installs.
HOOKS: tuple[Entry, ...] = (
    Entry(
        target=f"{_SCHED}._build_hisparse_decode_batch",
        kind=Kind.SOURCE_PATCH,
        sha256=None,
        why=(
            "0.5.13 builds the staged-to-decode batch without req_pool_indices_cpu; "
            "the first decode step then indexes None in the eager backup "
            "(TypeError at hisparse_coordinator.py:535) and every request dies. "
            "With logprobs requested it also sets token_ids_logprobs to each "
            "request's whole prompt, so every decode step gathers and returns the "
            "logprob of every prompt token id (about 0.7 ms of scheduler CPU per "
            "9K-token request per step on the H200, and junk "
            "output_token_ids_logprobs in every response); ours uses the ids the "
            "request asked for, as ScheduleBatch.init_new does for other batches."
        ),
        native_in=None,
        upstream=(
            "req_pool_indices_cpu: native in 0.5.15 srt/managers/scheduler.py:2572; "
            "token_ids_logprobs: still wrong in 0.5.23 srt/managers/scheduler.py:3870"
        ),
        removal=(
            "on a pin >= 0.5.15 drop the req_pool_indices_cpu hunk; keep the "
            "token_ids_logprobs hunk until upstream fixes it"
        ),
        process=Process.SCHEDULER,
        behaviour=(
            "the staged-to-decode batch carries req_pool_indices_cpu (0.5.13 leaves None)",
            "token_ids_logprobs holds the ids each request asked for, not its whole prompt",
        ),
        tests=("tests/test_plugin.py",),
    ),
    Entry(
        target=f"{_HISPARSE_HOOK}.validate_hisparse",
        kind=Kind.REPLACE,
        sha256=None,
        why=(
            "0.5.13 checks only the model class, radix cache, KV dtype and DSA "
            "backend (with asserts). It accepts invalid --hisparse-config JSON, "
            "unknown keys, device_buffer_size < top_k, --enable-mixed-chunk, "
            "speculative decoding (whose steps bypass the HiSparse data plane) "
            "and --pp-size > 1; these fail later, after weights load, or "
            "corrupt KV. Ours rejects all of them in check_server_args, listing "
            "every problem in one ValueError."
        ),
        native_in=None,
        impl="sglang_hisparse.adapter.args:validate_hisparse",
        upstream=(
            "0.5.23 srt/arg_groups/hisparse_hook.py:87-165 (mixed-chunk rule; "
            "speculative decoding allowed with topk 1 from 0.5.22, when its "
            "multi-token swap-in landed; no config or PP rules)"
        ),
        removal=(
            "keep: no release validates --hisparse-config at startup; on a pin "
            "upgrade re-hash and retarget (0.5.23 calls it from "
            "arg_groups/overrides.py:_hisparse_validation)"
        ),
        process=Process.LAUNCHER,
        behaviour=(
            "--hisparse-config is parsed by sglang_hisparse.config: invalid JSON, "
            "unknown keys, non-integer or out-of-range sizes are errors",
            "rejects --enable-mixed-chunk, speculative decoding and --pp-size > 1",
            "rejects swap-in sizes the kernel cannot run (slots per thread, shared memory)",
            "every problem in one ValueError naming the flag/field and allowed values "
            "(0.5.13 asserts one at a time)",
        ),
        tests=("tests/test_arg_hooks.py", "tests/test_config.py"),
    ),
    Entry(
        target=f"{_HISPARSE_HOOK}.apply_hisparse_dsa_backend_defaults",
        kind=Kind.REPLACE,
        sha256=None,
        why=(
            "Same defaults as 0.5.13 (bfloat16 -> flashmla_sparse, fp8_e4m3 -> "
            "flashmla_kv). Replaced so the backend we default to and the backend "
            "validate_hisparse accepts come from one table "
            "(sglang_hisparse.dsa_backends) and cannot drift apart."
        ),
        # The defaults themselves are native; the entry lives as long as our
        # validate_hisparse does, so it is not dropped by release.
        native_in=None,
        # The target's signature differs per release (0.5.15.post1's pin
        # records it moved to hisparse_hook._hisparse_default_backend(dtype),
        # asked by overrides._dsa_split_backend_resolution): the installed
        # release's hook, adapter/releases/.
        impl="sglang_hisparse.adapter.releases:dsa_backend_defaults",
        upstream=(
            "0.5.13 srt/arg_groups/hisparse_hook.py:23-46; 0.5.15 moved the "
            "defaults into arg_groups/overrides.py:_dsa_split_backend_resolution, "
            "which asks hisparse_hook._hisparse_default_backend"
        ),
        removal=(
            "droppable together with our validate_hisparse only; while that is "
            "ours, keep this so both read backends.DSA_BACKEND_BY_KV_CACHE_DTYPE"
        ),
        process=Process.LAUNCHER,
        behaviour=(
            "same defaults as 0.5.13, read from sglang_hisparse.dsa_backends (the "
            "table validate_hisparse checks against)",
            "an unsupported KV dtype leaves the backends alone (validation names it) "
            "instead of asserting here",
        ),
        tests=("tests/test_arg_hooks.py",),
    ),
    Entry(
        target=f"{_FACTORY}.parse_hisparse_config",
        kind=Kind.REPLACE,
        sha256=None,
        why=(
            "The pools, allocator and coordinator read --hisparse-config here. "
            "0.5.13 (via _parse_sparse_config) keeps unknown keys, takes true as "
            "a size, defaults top_k to 2048 whatever the model, and checks "
            "device_buffer_size against that default rather than the model's "
            "index_topk. Ours returns SparseConfig from sglang_hisparse.config "
            "(same rules and errors as startup), top_k = the model's index_topk, "
            "swap_in_block_size in sparse_extra_config."
        ),
        native_in=None,
        impl="sglang_hisparse.adapter.args:parse_hisparse_config",
        upstream=(
            "0.5.23 srt/mem_cache/sparsity/factory.py:62-117 (adds "
            "swap_in_block_size, still no key or type checks; no server_args "
            "parameter from 0.5.19)"
        ),
        removal=(
            "keep; on a pin >= 0.5.19 the signature is parse_hisparse_config() "
            "and our replacement must read get_memory() instead of server_args"
        ),
        process=Process.SCHEDULER,
        behaviour=(
            "same rules and errors as the startup check (unknown keys, bools, "
            "device_buffer_size < top_k)",
            "top_k is the model's index_topk (0.5.13: 2048 unless given)",
            "swap_in_block_size travels in sparse_extra_config",
        ),
        tests=("tests/test_arg_hooks.py", "tests/test_config.py"),
    ),
    # --- data plane (issue 3): our allocator / coordinator replace the native ones.
    Entry(
        target="sglang.srt.mem_cache.hisparse_memory_pool.HiSparseTokenToKVPoolAllocator",
        kind=Kind.REPLACE,
        sha256=None,
        why=(
            "Dual logical/physical allocator whose available_size() holds back the "
            "hot-buffer growth, newest-token page and host rows live requests still "
            "need (0.5.13 admits work the host pool cannot back: sglang#23704); "
            "page_size 1 decode; exposes the logical capacity; on a PD decode node "
            "hands retraction snapshots over as host rows (0.5.13 raises: sglang#40729)."
        ),
        native_in=None,
        impl="sglang_hisparse.pools.allocator:HiSparseDualAllocator",
        upstream="0.5.23 srt/mem_cache/allocator/hisparse.py:22-299",
        scope=Scope.DATA_PLANE,
        removal="keep: admission accounting is not upstream",
        process=Process.SCHEDULER,
        behaviour=(
            "available_size() holds back hot-buffer growth, the newest-token page, "
            "per-prefill claims and the host rows live requests still need",
            "available_size() counts the rows demoting residents would free; "
            "alloc/alloc_extend demote the largest residents when rows run short",
            "hisparse_attn_allocator / logical_attn_allocator report the same "
            "held-back budgets to the PD decode prealloc",
            "logical_capacity: the host-backed logical space (max_token_pool_size)",
            "get_cpu_copy / load_cpu_copy hand a PD-decode retraction over as "
            "retained host rows (0.5.13 raises)",
        ),
        tests=(
            "tests/test_allocator.py",
            "tests/test_residency.py",
            "tests/test_disaggregation.py",
        ),
    ),
    _data_plane_hook(
        target="sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool",
        kind=Kind.REPLACE,
        why=(
            "The last native HiSparse class on the DSA data path: the GPU pool whose "
            "latent KV is indexed by physical rows (mapping registered by our "
            "allocator) while the indexer K cache spans the logical space. Ours "
            "keeps 0.5.13's buffers and translation exactly (-1 padding stays -1) "
            "and fails with a clear error when used before a mapping is registered "
            "or asked for a retraction snapshot."
        ),
        impl="sglang_hisparse.pools.device_dsa:HiSparseDSADevicePool",
        upstream=(
            "0.5.13 srt/mem_cache/hisparse_memory_pool.py:38-132 (the class we "
            "replace); later releases not re-checked for this entry"
        ),
        behaviour=(
            "same buffers, shapes and dtypes as 0.5.13; latent rows sized for the "
            "physical space, indexer K for the logical space",
            "every read/write location translated logical -> physical through the "
            "allocator's mapping (held by weakref proxy); -1 padding stays -1",
            "a clear error when used before a mapping is registered or asked for a "
            "retraction snapshot (get_cpu_copy)",
        ),
        tests=("tests/test_device_pool.py",),
    ),
    _data_plane_hook(
        target="sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator",
        kind=Kind.REPLACE,
        why=(
            "Our coordinator: host-wait instead of a crash when the host pool is "
            "exhausted, idempotent release in every state, swap-in through "
            "sglang_hisparse.kernels, hit/miss/byte counters, destroy(); a request "
            "retracted on a PD decode node keeps its KV on host and resumes from it."
        ),
        impl="sglang_hisparse.adapter.model_runner:HiSparseCoordinator",
        upstream="0.5.23 srt/managers/hisparse_coordinator.py:533-1637",
        behaviour=(
            "residency: a request past prefill keeps its whole KV on the GPU (no host "
            "IO, the swap-in only translates) while rows allow; when rows run short "
            "the largest residents are demoted to hot buffers "
            "(SGLANG_HISPARSE_RESIDENCY=0: stage every request)",
            "parking: a staged request whose hot buffer would take rows the next "
            "prefill needs waits on host holding no GPU row, and joins first come "
            "first served once rows allow (SGLANG_HISPARSE_PARKING=0: join at once); "
            "with streaming on (default) only for the prefill in flight, not for "
            "prompts not yet started (SGLANG_HISPARSE_STREAMING=0: prefill-ahead)",
            "PD-decode retraction keeps the request's KV in the host pool and resumes "
            "from it (0.5.13 raises: sglang#40729)",
            "an exhausted host pool makes admission wait and retry (0.5.13 crashes)",
            "release is idempotent in every state (waiting, staging, parked, resident, "
            "running, retracted) and returns every host and device row",
            "num_real_reqs is a RealRequestCount object, not a tensor: fill_(n) skips "
            "a write that would not change it, .tensor is the int32 [1] the kernel "
            "reads; SGLang code that uses it as a tensor beyond fill_ breaks",
            "admission accounting drift never kills the scheduler: a staged request "
            "without rows parks, a running one that cannot be served is finished "
            "with an abort naming the cause; each is logged and counted",
            "SGLANG_HISPARSE_CHECK=1: every swap-in's rows are checked against the "
            "authoritative KV (engine/exactness.py)",
            "swap-in runs sglang_hisparse.kernels (our JIT kernel; the torch "
            "reference on CPU), never 0.5.13's jit_kernel.hisparse",
            "hit/miss/byte counters for the decode log line and Prometheus; destroy()",
        ),
        tests=(
            "tests/test_coordinator.py",
            "tests/test_residency.py",
            "tests/test_parking.py",
            "tests/test_streaming.py",
            "tests/test_disaggregation.py",
            "tests/test_soak.py",
        ),
    ),
    Entry(
        target="sglang.srt.model_executor.model_runner.ModelRunner.max_token_pool_size",
        kind=Kind.PROPERTY,
        sha256=None,
        why=(
            "0.5.13 caps the max request length at the GPU pool; with HiSparse the "
            "host-backed logical space is the limit."
        ),
        native_in="0.5.19",
        impl="sglang_hisparse.adapter.model_runner:model_runner_max_token_pool_size",
        upstream="0.5.23 srt/model_executor/model_runner.py:1516-1524",
        scope=Scope.DATA_PLANE,
        removal="drop on a pin >= 0.5.19 (logical max-req-len is native)",
        process=Process.SCHEDULER,
        tests=("tests/test_coordinator.py",),
    ),
    Entry(
        target="sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator."
               "_compute_cell_size",
        kind=Kind.AFTER,
        sha256=None,
        scope=Scope.DATA_PLANE,
        process=Process.SCHEDULER,
        why=(
            "0.5.13 sizes the device pool from GPU memory by a per-token cell that counts "
            "a DSA token's indexer K once; the HiSparse pool holds the indexer for the "
            "logical space (host_to_device_ratio x the rows), so an auto-sized pool "
            "over-commits the GPU by (ratio - 1) indexer copies per token and layer; "
            "under MTP the draft's pool spans the logical space too, and its (ratio - 1) "
            "extra rows are charged here as well."
        ),
        native_in="0.5.17",
        impl="sglang_hisparse.adapter.model_runner:hisparse_indexer_cell_size",
        upstream="0.5.17 srt/model_executor/pool_configurator.py:183-239 (indexer at the ratio)",
        removal="drop with the last pin before 0.5.17 (native there)",
        tests=("tests/test_host_memory_budget.py",),
        # 0.5.17 charges the ratio itself: no later pin hashes it.
        until="0.5.15.post1",
    ),
    Entry(
        target=f"{_SCHED}.abort_request",
        kind=Kind.AROUND,
        sha256=None,
        why=(
            "0.5.13 leaks the hot buffer and host rows of an aborted PD-decode "
            "waiting-queue request (and, with our retraction, the host rows a "
            "retracted request keeps) and loses aborts of requests still staging."
        ),
        native_in=None,
        impl="sglang_hisparse.adapter.scheduler:scheduler_abort_request",
        upstream="0.5.23 srt/managers/scheduler.py:5708-5709 (PD waiting queue only)",
        scope=Scope.DATA_PLANE,
        removal="keep the staging part; the PD part is native from 0.5.22",
        process=Process.SCHEDULER,
        tests=("tests/test_coordinator.py", "tests/test_disaggregation.py"),
    ),
    _data_plane_hook(
        target=f"{_SCHED}.on_idle",
        kind=Kind.AFTER,
        why=(
            "0.5.13 skips its idle memory-leak check whenever HiSparse is on (its pool "
            "counters do not add up under host backup), so a server with "
            "--enable-hisparse has none; ours checks the pools HiSparse serves from "
            "(device rows, host rows, logical / full and SWA ids, request slots) "
            "against the first idle moment and warns with SGLang's reporter."
        ),
        impl="sglang_hisparse.adapter.scheduler:scheduler_on_idle",
        upstream="none: 0.5.23 still skips it under HiSparse (srt/managers/scheduler.py:5281-5291)",
        tests=("tests/test_idle_leak_check.py",),
    ),
    _data_plane_hook(
        target=f"{_SCHED}.get_next_batch_to_run",
        kind=Kind.AROUND,
        why=(
            "Parking needs the scheduler's pending prefill work (waiting queue, "
            "chunked request, running batch) where collect_ready_reqs runs: a "
            "staged request then waits on host instead of taking a hot buffer a "
            "waiting prompt needs, so the batch is bounded by hot buffers, not "
            "by prefill rows."
        ),
        impl="sglang_hisparse.adapter.scheduler:scheduler_get_next_batch_to_run",
        upstream="none: 0.5.23 joins every staged request at once (srt/managers/scheduler.py:3923)",
        tests=("tests/test_parking.py",),
    ),
    _data_plane_hook(
        target=f"{_SCHED}.get_new_batch_prefill",
        kind=Kind.AROUND,
        why=(
            "0.5.13 runs a prefill batch whenever one can be formed; with HiSparse "
            "every queued prompt is admitted, so requests that have streamed wait "
            "for all of them. Streaming: while requests decode, one capped prefill "
            "batch per decode step, and no new prompt while a streamed request is "
            "parked (SGLANG_HISPARSE_STREAMING=0: 0.5.13's order)."
        ),
        impl="sglang_hisparse.adapter.scheduler:scheduler_get_new_batch_prefill",
        upstream="none: 0.5.23 prefers prefill as 0.5.13 does (srt/managers/scheduler.py)",
        tests=("tests/test_streaming.py",),
    ),
    _data_plane_hook(
        target=(
            "sglang.srt.managers.scheduler_components.output_streamer."
            "SchedulerOutputStreamer.stream_output"
        ),
        kind=Kind.AROUND,
        why=(
            "0.5.13 streams a request's first token when prefill ends; under "
            "HiSparse the request then stages and may park before it decodes, so "
            "its client waited up to 47 x its median gap after the first token "
            "(2026-12-06-s5, streaming on). Streaming: a request outside the batch "
            "that has sent nothing sends its first token with its second, once it "
            "decodes (SGLANG_HISPARSE_STREAMING=0: 0.5.13's)."
        ),
        impl="sglang_hisparse.adapter.output_streamer:streamer_stream_output",
        upstream="none: 0.5.23 streams the first token at prefill's end "
                 "(srt/managers/scheduler_components/output_streamer.py)",
        tests=("tests/test_streaming.py",),
    ),
    _data_plane_hook(
        target=f"{_ADDER}.__init__",
        kind=Kind.AFTER,
        why=(
            "0.5.13 charges the running requests' expected tokens "
            "(rem_total_token_offset) to available_size(), whose device side binds "
            "under HiSparse; a HiSparse request's device rows do not grow (its hot "
            "buffer is fixed from staging to finish), its new tokens take host rows. "
            "Ours credits them back on the device side: rem_total_tokens = "
            "min(host - growth, device) - the batch's own prompts and outputs "
            "(SGLANG_HISPARSE_HOST_GROWTH=0: 0.5.13's). Also relied on: the DSV4 "
            "allocator class is looked up by name at call time (pools/allocator_c4)."
        ),
        impl=_GROWTH_ON_HOST,
        upstream="none: 0.5.23 charges decode growth to available_size() (srt/managers/schedule_policy.py)",
        tests=("tests/test_prefill_adder.py", "tests/test_parking.py", "tests/test_dsv4.py"),
    ),
    _data_plane_hook(
        target=f"{_ADDER}.add_one_req",
        kind=Kind.AROUND,
        why=(
            "0.5.13 checks a prompt that stops at EOS, with its clipped output (up "
            "to 4096 tokens), against available_size(), whose device side binds "
            "under HiSparse, and keeps that output charged there for the rest of the "
            "adder pass; the output takes host rows. Ours checks prompt and output "
            "against the host side and the prompt alone against the device rows the "
            "pass's prompts leave (cur_rem_token_offset). ignore_eos prompts pass "
            "through to add_one_req_ignore_eos (SGLANG_HISPARSE_HOST_GROWTH=0: 0.5.13's). "
            "Also relied on (parking's demand, the streaming cap): a waiting request "
            "costs extend_input_len + min(max_new_tokens - outputs, CLIP_MAX_NEW_TOKENS) "
            "+ page_size, admitted while < rem_total_tokens; cut at rem_chunk_tokens."
        ),
        impl=_ADD_ONE_REQ_HOOK,
        upstream="none: 0.5.23 charges the output to available_size() (srt/managers/schedule_policy.py)",
        tests=("tests/test_prefill_adder.py", "tests/test_parking.py", "tests/test_streaming.py"),
    ),
    _data_plane_hook(
        target=f"{_ADDER}.add_one_req_ignore_eos",
        kind=Kind.AROUND,
        why=(
            "With ignore_eos and the radix cache off (HiSparse requires it) 0.5.13 "
            "simulates every request to its end against available_size(): 16 x 32K "
            "prompts x 6144 out ran at most 11 at once, one more every ~5 s "
            "(2026-12-06-s5). Ours checks the prompt against both sides, then runs "
            "the simulation against host rows only."
        ),
        impl=_IGNORE_EOS_HOOK,
        upstream="none: 0.5.23 has the same simulation (srt/managers/schedule_policy.py)",
        tests=("tests/test_prefill_adder.py",),
    ),
    _data_plane_hook(
        target=f"{_BATCH}.check_decode_mem",
        kind=Kind.AROUND,
        why=(
            "0.5.13 retracts a running request when available_size() < the next "
            "decode step's tokens; under HiSparse those tokens take host rows (a hot "
            "buffer's device rows are reserved at staging), so a full device side (a "
            "prompt's chunks, or hot buffers) retracted decoding requests, which then "
            "prefilled again (3 retractions on 2026-12-06-s5, an 11.6 s gap in a stream). Ours runs "
            "the check with available_size() answering the host side "
            "(SGLANG_HISPARSE_HOST_GROWTH=0: 0.5.13's)."
        ),
        impl=_DECODE_CHECK_HOOK,
        upstream="none: 0.5.23 checks available_size() (srt/managers/schedule_batch.py)",
        tests=("tests/test_prefill_adder.py",),
    ),
    Entry(
        target=(
            "sglang.srt.managers.scheduler_components.pool_stats_observer."
            "PoolStats.get_decode_usage_msg_parts"
        ),
        kind=Kind.AFTER,
        sha256=None,
        why=(
            "The decode log line shows only token counts; users need the hit rate, "
            "misses and host traffic to size the hot buffer. The same reading feeds "
            "Prometheus counters under --enable-metrics (0.5.13 exports none)."
        ),
        native_in=None,
        impl="sglang_hisparse.adapter.metrics:decode_usage_msg_parts",
        upstream="none: 0.5.23 logs token counts only (pool_stats_observer.py:138-143)",
        scope=Scope.DATA_PLANE,
        removal="keep",
        process=Process.SCHEDULER,
        tests=("tests/test_metrics.py",),
    ),
    Entry(
        target=(
            "sglang.srt.managers.scheduler_components.pool_stats_observer."
            "SchedulerPoolStatsObserver._get_hisparse_token_info"
        ),
        kind=Kind.REPLACE,
        sha256=None,
        why=(
            "SGLang reads pool stats for every streamed output, i.e. every decode "
            "step, and 0.5.13 adds the HiSparse fields with dataclasses.replace, a "
            "full copy of a 19-field PoolStats; ours sets the same fields on the "
            "fresh PoolStats get_pool_stats just built (a lone request's step is "
            "scheduler CPU on small models)."
        ),
        native_in=None,
        impl="sglang_hisparse.adapter.metrics:pool_stats_with_hisparse",
        upstream="none: 0.5.23 still copies (pool_stats_observer.py:248-259)",
        scope=Scope.DATA_PLANE,
        removal="keep while the copy is upstream; drop if get_pool_stats stops building fresh stats",
        process=Process.SCHEDULER,
        behaviour=(
            "sets the HiSparse fields on the PoolStats get_pool_stats just built "
            "instead of copying it with dataclasses.replace",
        ),
        tests=("tests/test_coordinator.py", "tests/test_metrics.py"),
    ),
    # --- data plane, DeepSeek-V4 (C4 layers): allocator and C4 device pool.
    _data_plane_hook(
        target="sglang.srt.mem_cache.hisparse_memory_pool.DeepSeekV4HiSparseTokenToKVPoolAllocator",
        kind=Kind.REPLACE,
        why=(
            "0.5.13's allocator never frees the C4 rows of a request released before "
            "staging (finished at prefill, aborted, retracted), pins an extra C4 page "
            "per long hot buffer, has no backup_state/restore_state/"
            "merge_and_sort_free (base class, None free lists) and no admission "
            "accounting for hot buffers or host rows. Ours wraps the same SWA "
            "allocator, frees C4 rows on free(), keeps each hot buffer to exactly "
            "need_size / c4_page_size pages and shares the DSA allocator's "
            "reservation logic (in C4 rows)."
        ),
        impl="sglang_hisparse.pools.allocator_c4:DSV4HiSparseAllocator",
        upstream="0.5.23 srt/mem_cache/allocator/hisparse.py:302-670",
        behaviour=(
            "free() frees the C4 rows of a request released before staging "
            "(finished at prefill, aborted, retracted); 0.5.13 leaks them",
            "each hot buffer is exactly need_size / c4_page_size pages (0.5.13 pins "
            "an extra C4 page per long buffer)",
            "backup_state / restore_state / merge_and_sort_free work (0.5.13: base "
            "class, None free lists)",
            "admission accounting for hot buffers and host rows, in C4 rows, shared "
            "with the DSA allocator",
            "PD-decode retraction stays unsupported: get_cpu_copy raises as in 0.5.13",
        ),
        tests=("tests/test_dsv4.py",),
    ),
    _data_plane_hook(
        target="sglang.srt.mem_cache.deepseek_v4_memory_pool.HiSparseC4DevicePool",
        kind=Kind.REPLACE,
        why=(
            "The last native HiSparse class on the DeepSeek-V4 path: the C4 pool "
            "that translates compressed write locations to hot-buffer rows through "
            "the mapping our DSV4 allocator registers. Same buffers, data_ptrs and "
            "translation as 0.5.13; replaced so the whole C4 data plane is ours."
        ),
        impl="sglang_hisparse.pools.device_c4:DSV4C4DevicePool",
        upstream="0.5.23 srt/mem_cache/deepseek_v4_memory_pool.py:437-527",
        behaviour=(
            "same buffers, data_ptrs and translation as 0.5.13; the mapping comes "
            "from our DSV4 allocator",
        ),
        tests=("tests/test_dsv4.py",),
    ),
    # --- speculative decoding (MTP/EAGLE v2): still refused by the argument
    # rules; these seams are wired one by one (adapter/speculative.py).
    _data_plane_hook(
        target="sglang.srt.speculative.eagle_info_v2.EagleDraftInputV2Mixin.prepare_for_decode",
        kind=Kind.AROUND,
        why=(
            "The spec reserve (the next draft and verify positions) goes through our "
            "allocator's alloc_extend, which would give every position a device row; the "
            "verify step maps them to hot-buffer slots, so the reserve takes logical "
            "slots only."
        ),
        impl="sglang_hisparse.adapter.speculative:eagle_prepare_for_decode",
        upstream="0.5.23 srt/mem_cache/allocation.py:801-823 (logical-only spec reserve)",
        tests=("tests/test_verify_step.py", "tests/test_soak.py"),
        # 0.5.15 made it a module function, speculative.eagle_utils.
        # eagle_prepare_for_decode(batch): its entry comes with the MTP wiring.
        until="0.5.13.post1",
    ),
    _data_plane_hook(
        target="sglang.srt.speculative.eagle_info_v2.EagleVerifyInputV2Mixin.prepare_for_v2_verify",
        kind=Kind.AFTER,
        why=(
            "The verify forward writes the draft tokens' KV at out_cache_loc through the "
            "allocator's mapping; the verify slots must point at hot-buffer rows first "
            "(host rows reserved up to kv_allocated_len, short buffers grown), from the "
            "device seq_lens: under the overlap scheduler the CPU does not know the "
            "previous step's accept lengths yet."
        ),
        impl="sglang_hisparse.adapter.speculative:map_verify_slots",
        upstream="0.5.23 srt/speculative/eagle_utils.py:365-366 (prepare), "
                 "managers/hisparse_coordinator.py:352-374",
        tests=("tests/test_verify_step.py", "tests/test_speculative_seams.py"),
        until="0.5.13.post1",
    ),
    _data_plane_hook(
        target="sglang.srt.speculative.eagle_info_v2.EagleVerifyInputV2Mixin.sample",
        kind=Kind.AFTER,
        why=(
            "Under speculation 0.5.13 never runs map_last_loc_to_buffer, so nothing "
            "writes a verified token through to host; after the verify forward the "
            "commit queues all draft positions' write-through and unmaps the verify "
            "slots (no accept length needed on the CPU)."
        ),
        impl="sglang_hisparse.adapter.speculative:commit_verify_slots",
        upstream="0.5.23 srt/speculative/eagle_worker_common.py:717-720 (commit)",
        tests=("tests/test_verify_step.py", "tests/test_speculative_seams.py"),
        until="0.5.13.post1",
    ),
    _data_plane_hook(
        target=f"{_DSA}.get_indexer_metadata",
        kind=Kind.AFTER,
        why=(
            "0.5.13 forces the unfused top-k (raw token positions, what the swap-in "
            "resolves) only for decode; a verify step's rows need positions too, or the "
            "fused kernel hands back logical slots."
        ),
        impl="sglang_hisparse.adapter.speculative:verify_indexer_metadata",
        upstream="0.5.23 srt/layers/attention/dsa_backend.py:4130-4136",
        tests=("tests/test_speculative_seams.py",),
    ),
    _data_plane_hook(
        target=f"{_DSA}.forward_extend",
        kind=Kind.SOURCE_PATCH,
        why=(
            "0.5.13 translates every extend page table through the logical-to-row "
            "mapping, which holds no row for a token that lives on host; a verify step's "
            "rows are resolved by the union swap-in instead (swap_in_selected_pages with "
            "one row per draft token, seq_lens expanded per row)."
        ),
        upstream="0.5.23 srt/layers/attention/dsa_backend.py:2327-2341 (spec swap)",
        behaviour=(
            "TARGET_VERIFY with HiSparse: the page table is the union swap-in's output "
            "(physical rows, int32) for the top-k positions of each verify row",
            "every other extend: unchanged (translate_loc_to_hisparse_device, then int32)",
        ),
        tests=("tests/test_speculative_seams.py", "tests/test_device_pool.py"),
    ),
    _data_plane_hook(
        target=f"{_MR}.initialize",
        kind=Kind.BEFORE,
        why=(
            "The draft (NextN) runner copies enable_hisparse from the server args and "
            "would build a second coordinator and host pool over the target's shared "
            "allocator (sglang#23153); it keeps its one layer's KV on the GPU. Also "
            "relied on: it builds the target's coordinator (cuda/musa only, before "
            "init_attention_backend and graph capture) with 0.5.13's fixed keywords from "
            "parse_hisparse_config, top_k = the model's index_topk."
        ),
        relied_on_by=(_COORD, "sglang_hisparse.adapter.args:parse_hisparse_config"),
        impl="sglang_hisparse.adapter.speculative:draft_runner_without_hisparse",
        upstream="0.5.23 srt/model_executor/model_runner.py:413-415",
        tests=("tests/test_speculative_seams.py",),
    ),
    _data_plane_hook(
        target=f"{_KV_MIXIN}._init_pools",
        kind=Kind.AROUND,
        why=(
            "The draft runner sizes its pool by the target's device token count, but "
            "the shared allocator hands out logical slots up to the host-backed logical "
            "space; the draft's pool spans it. Also relied on: it constructs the DSA "
            "device pool, the dual allocator and the DSV4 allocator with fixed keywords "
            "(class REPLACE targets), host_to_device_ratio from parse_hisparse_config."
        ),
        relied_on_by=(
            _ALLOC,
            "sglang_hisparse.pools.device_dsa:HiSparseDSADevicePool",
            "sglang_hisparse.pools.allocator_c4:DSV4HiSparseAllocator",
            "sglang_hisparse.adapter.args:parse_hisparse_config",
        ),
        impl="sglang_hisparse.adapter.speculative:draft_pool_for_logical_ids",
        upstream="0.5.23 srt/model_executor/kv_cache_configurator.py:729-740",
        tests=("tests/test_speculative_seams.py", "tests/test_allocator.py",
               "tests/test_device_pool.py", "tests/test_dsv4.py"),
    ),
    # --- PD decode: the prealloc's host rows.
    _data_plane_hook(
        target=f"{_PREALLOC}._pre_alloc",
        kind=Kind.SOURCE_PATCH,
        why=(
            "0.5.13 takes host rows for the transfer and tells nobody: a transfer that "
            "fails or is aborted in flight releases the request's logical slots but its "
            "host rows stay behind, and a request resuming from retraction takes fresh "
            "rows for its whole KV beside the rows it kept (load_cpu_copy then swaps "
            "them), so with a full host pool no retracted request can ever resume (the "
            "pd-press stall of the third GPU session). Ours asks the coordinator, which "
            "hands a resuming request its kept rows back and holds every request from "
            "its prealloc on (TRANSFERRING)."
        ),
        upstream="none: 0.5.23 srt/disaggregation/decode.py allocates host rows the same way",
        behaviour=(
            "host rows come from coordinator.prealloc_host_rows(req, fill_len): the same "
            "rows and indices for a new transfer; for a request resuming from retraction "
            "the rows it kept (no fresh allocation, no copy)",
            "the coordinator holds the request from here (TRANSFERRING): a failed or "
            "aborted transfer's request_finished frees its host rows (0.5.13 leaves them)",
        ),
        tests=("tests/test_disaggregation.py", "tests/test_pd_node.py"),
    ),
    # --- PD decode: a retraction that rebootstraps keeps nothing on host.
    _data_plane_hook(
        target=f"{_BATCH_MOD}.release_req",
        kind=Kind.AROUND,
        why=(
            "A PD decode retraction hands the request's KV over as a CPU copy: retract_req "
            "(unless finished), then Req.offload_kv_cache, then release_kv_cache"
            "(is_insert=False); ours keeps the host rows for that copy. 0.5.17's "
            "pause_generation(mode='retract') rebootstraps instead (the prefill recomputes "
            "the KV) and passes offload_kv=False: no copy is taken, so the kept rows would "
            "leak and the next retraction would find the hand-off taken. Ours releases "
            "every row of such a retraction. Releases before 0.5.17 have no offload_kv: "
            "the hook passes the call through."
        ),
        impl="sglang_hisparse.adapter.scheduler:release_req_without_offload",
        upstream="none: 0.5.17 srt/managers/scheduler.py:4511-4520 (retract_all, offload_kv=False)",
        behaviour=(
            "release_req(..., offload_kv=False) with our coordinator: the request's host "
            "rows are released with its hot buffer (0.5.17 would have them retained for "
            "a copy nobody takes)",
            "every other call: unchanged",
        ),
        relied_on_by=(f"{_COORD}.retract_req", f"{_RETAIN}.retract_to_host"),
        tests=("tests/test_disaggregation.py",),
    ),
    # --- PD prefill: a failed state transfer must fail the request (any server).
    Entry(
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker",
        kind=Kind.SOURCE_PATCH,
        sha256=None,
        why=(
            "The prefill's transfer worker sends the last chunk's state data (DSA's "
            "indexer K, SWA windows, Mamba states) with maybe_send_extra and drops its "
            "return code: a failed state transfer is reported to the decode as Success, "
            "which then decodes on an index K it never received (silent corruption, no "
            "log line). Ours fails the request as a failed KV chunk does. It also reads the "
            "device-tail pages a HiSparse DeepSeek-V4 decode packs behind its host pages "
            "(pop_preallocated patch) and hands each chunk's slice to send_kvcache. It runs "
            "on the prefill server, which has no --enable-hisparse, and is a fix for any "
            "server: scope ALWAYS, whatever the decode side runs."
        ),
        native_in="0.5.17",
        upstream=(
            "0.5.17 srt/disaggregation/mooncake/conn.py:1738-1766 (state_rc: the session "
            "and the room fail, decode is told); 0.5.15.post1 conn.py:1378-1392 drops it"
        ),
        scope=Scope.ALWAYS,
        removal="drop with the last pin before 0.5.17 (native there)",
        # 0.5.17 fails the request on the state transfer's return code itself.
        until="0.5.15.post1",
        process=Process.SCHEDULER,
        behaviour=(
            "a non-zero return of maybe_send_extra makes the request's poll Failed on "
            "prefill and decode (0.5.13: Success), with a failure record naming the room "
            "and the decode endpoint",
            "a destination whose metadata vector carries device-tail pages "
            "(disaggregation_device_index): each chunk sends its host slice as the KV "
            "pages and its device slice to send_kvcache (dst_device_kv_indices); plain "
            "vectors: unchanged",
        ),
        tests=("tests/test_pd_transfer.py", "tests/test_pd_device_index.py"),
    ),
    # --- PD with a HiSparse DeepSeek-V4 decode: the device tail's own page
    # indices (adapter/disaggregation_device_index.py). Decode side.
    Entry(
        target=f"{_PREALLOC}.pop_preallocated",
        kind=Kind.SOURCE_PATCH,
        sha256=None,
        why=(
            "A HiSparse DeepSeek-V4 decode registers the host pool's C4 layers and, after "
            "them, the device pool's C4 indexer and C128 buffers (addressed by logical "
            "page), but sends only the host pages: the prefill writes the device tail at "
            "host page numbers, other requests' rows. Ours packs the request's logical pages "
            "(req_to_token through kv_to_page_indices) behind the host pages in the metadata "
            "vector, in a format a prefill without this plugin fails on before any byte "
            "moves. Also relied on, unchanged: the request budget "
            "(hisparse_attn_allocator.available_size() // padded_buffer_size - transfer "
            "queue), indices paged by hisparse_page_size, every SWA state component gets the "
            "window's SWA pages (the draft SWA registration)."
        ),
        native_in="0.5.17",
        upstream="0.5.17 srt/disaggregation/decode.py:1252-1277 (device_kv_indices)",
        scope=Scope.ALWAYS,
        removal="drop with the last pin before 0.5.17 (native there), with the send_kvcache hook",
        # 0.5.17 sends device_kv_indices itself (a TransferInfo field of its own).
        until="0.5.15.post1",
        process=Process.SCHEDULER,
        behaviour=(
            "HiSparse on a DeepSeek-V4 pool: the metadata vector is [host pages + 2**30, "
            "logical pages, host-backed entry count, page count, tag] "
            "(disaggregation_device_index.pack_device_tail_pages) instead of the host pages",
            "every other decode (no HiSparse, DSA models): unchanged",
        ),
        tests=("tests/test_pd_device_index.py", "tests/test_pd_node.py"),
    ),
    # Prefill side: the device tail written at the pages the decode sent for it.
    Entry(
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache",
        kind=Kind.AROUND,
        sha256=None,
        why=(
            "With a HiSparse DeepSeek-V4 decode, its registered KV entries are host-backed "
            "(the C4 layers, host pages) then device-backed (C4 indexer, C128: logical "
            "pages); 0.5.13 sends every entry with one index vector. Ours sends the first "
            "part with the host pages and the device tail with the logical pages the "
            "decode packed beside them (the transfer_worker patch unpacks them), each "
            "through SGLang's _send_kvcache_generic. It runs on the prefill server, which "
            "has no --enable-hisparse: scope ALWAYS."
        ),
        native_in="0.5.17",
        impl="sglang_hisparse.adapter.disaggregation_device_index:send_kvcache_with_device_tail",
        upstream="0.5.17 srt/disaggregation/mooncake/conn.py:631-719, 771-803 (dst_device_kv_indices)",
        scope=Scope.ALWAYS,
        removal="drop with the last pin before 0.5.17 (native there), with the pop_preallocated patch",
        until="0.5.15.post1",
        process=Process.SCHEDULER,
        tests=("tests/test_pd_device_index.py",),
    ),
    # --- PD disaggregation with a draft model, DeepSeek-V4 (HiSparse or not).
    Entry(
        target=f"{_DISAGG_UTILS}.setup_state_kv_args",
        kind=Kind.AFTER,
        sha256=None,
        why=(
            "With EAGLE/MTP on both PD sides of DeepSeek-V4, the prefill computes the draft "
            "NextN layer's SWA KV for the prompt, but the transfer registers only the target "
            "pool's state (an SWA-only draft has no contiguous KV either), so decode starts "
            "with the draft's window missing or stale and early drafts are accepted less "
            "often. Ours checks that the draft is SWA-only and shares the target's KV mode, "
            "full-to-SWA mapping and page geometry (a start-up RuntimeError names every "
            "difference), then registers the draft's SWA buffers as an SWA state component "
            "of their own after the target's. Whether HiSparse is on does not matter (it "
            "leaves the SWA pools alone); prefill and decode both need the plugin, since "
            "components are matched by position."
        ),
        native_in="0.5.16",
        impl="sglang_hisparse.adapter.disaggregation_dsv4:register_draft_swa_state",
        upstream=(
            "0.5.16 srt/disaggregation/utils.py:951-1025 (paged: StateType.SWA, as ours; "
            "unified KV: StateType.SWA_RING, which ours leaves as the release has it)"
        ),
        scope=Scope.ALWAYS,
        removal=(
            "drop on a pin >= 0.5.16 (native there), with the DEPENDS entries only "
            "adapter.disaggregation_dsv4 relies on"
        ),
        process=Process.SCHEDULER,
        tests=("tests/test_dsv4_draft_swa.py",),
        # 0.5.16 registers the draft itself: no later pin hashes it.
        until="0.5.15.post1",
    ),
    # --- the native comparison mode (SGLANG_HISPARSE_NATIVE=1) only.
    Entry(
        target="sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator.swap_in_selected_pages",
        kind=Kind.AROUND,
        sha256=None,
        why=(
            "Benchmark-only: SGLANG_HISPARSE_SYNTHETIC_TOPK replaces the indexer's top-k "
            "before SGLang's own swap-in as it does before ours, so the native comparison "
            "sees the same trace (its entries are distinct, as that kernel assumes). "
            "Without the switch it passes every call through."
        ),
        native_in=None,
        impl="sglang_hisparse.adapter.native:native_swap_in_selected_pages",
        scope=Scope.NATIVE,
        removal="with the native comparison mode",
        process=Process.SCHEDULER,
        tests=("tests/test_synthetic_top_k.py",),
    ),
)


def _depends(
    target: str,
    why: str,
    relied_on_by: tuple[str, ...],
    *,
    process: Process = Process.SCHEDULER,
    scope: Scope = Scope.DATA_PLANE,
    tests: tuple[str, ...] = (),
    since: str | None = None,
    until: str | None = None,
) -> Entry:
    return Entry(
        target=target,
        kind=Kind.DEPENDS,
        sha256=None,
        why=why,
        native_in=None,
        process=process,
        scope=scope,
        relied_on_by=relied_on_by,
        tests=tests,
        since=since,
        until=until,
        removal=(
            "hash only: re-read relied_on_by when the target changes; drop with "
            "the code that relies on it"
        ),
    )


def _draft_swa_depends(target: str, why: str, tests: tuple[str, ...] = ()) -> Entry:
    """A dependency of the DeepSeek-V4 draft's SWA registration: an ALWAYS
    hook, so checked with or without our data plane; like the hook, up to
    0.5.15.post1 (0.5.16 registers the draft itself)."""
    return _depends(target, why, (_DRAFT_SWA,), scope=Scope.ALWAYS, tests=tests,
                    until="0.5.15.post1")


# DEPENDS: the SGLang code our code is called from or mirrors, hashed so that
# a release that changes it fails doctor and activation until a person has
# re-read our side. Hashes come from `scripts/rebase.py --hash TARGET...`.
DEPENDS: tuple[Entry, ...] = (
    # --- plugin loading: how our hooks get installed (and taken back).
    _depends(
        "sglang.srt.plugins.hook_registry.HookRegistry",
        "register/apply_hooks install BEFORE/AFTER/AROUND/REPLACE; a failing target "
        "is logged and skipped; no unregister, so rollback edits _hooks/_patched",
        (
            "sglang_hisparse.adapter.hook_registry:install",
            "sglang_hisparse.adapter.hook_registry:rollback",
        ),
        process=Process.BOTH,
        scope=Scope.ALWAYS,
        tests=("tests/test_plugin.py",),
    ),
    _depends(
        "sglang.srt.plugins.hook_registry._propagate_patch",
        "a replaced object is rebound in every module that imported it by name "
        "(rollback walks sys.modules back)",
        ("sglang_hisparse.adapter.hook_registry:rollback",),
        process=Process.BOTH,
        scope=Scope.ALWAYS,
        tests=("tests/test_plugin.py",),
    ),
    _depends(
        "sglang.srt.plugins.load_plugins",
        "calls our register() once per process (SGLANG_PLUGINS whitelist), then "
        "apply_hooks() again: a rolled-back hook must not stay registered",
        ("sglang_hisparse.plugin:register", "sglang_hisparse.adapter.hook_registry:rollback"),
        process=Process.BOTH,
        scope=Scope.ALWAYS,
        tests=("tests/test_plugin.py", "tests/test_packaging.py"),
    ),
    # --- the launcher: where SGLang calls our argument hooks.
    _depends(
        f"{_SERVER_ARGS}.check_server_args",
        "calls hisparse_hook.validate_hisparse(self) through a function-local "
        "import (our REPLACE) in the launcher, before any weights load",
        ("sglang_hisparse.adapter.args:validate_hisparse",),
        process=Process.LAUNCHER,
        scope=Scope.ALWAYS,
        tests=("tests/test_arg_hooks.py",),
    ),
    _depends(
        f"{_SERVER_ARGS}._set_default_dsa_backends",
        "calls apply_hisparse_dsa_backend_defaults(self, user_set_prefill, "
        "user_set_decode, kv_cache_dtype) with the resolved dtype and skips its "
        "own defaults when it returns True",
        ("sglang_hisparse.adapter.args:apply_hisparse_dsa_backend_defaults",),
        process=Process.LAUNCHER,
        scope=Scope.ALWAYS,
        tests=("tests/test_arg_hooks.py",),
    ),
    # --- the model runner: pools, coordinator, per-step calls.
    _depends(
        f"{_MR}._forward_raw",
        "each decode forward calls wait_for_pending_backup() then "
        "num_real_reqs.fill_(batch_size) before graph replay; eager forwards fill again",
        (f"{_COORD}.wait_for_pending_backup", f"{_COUNT}.fill_"),
        tests=("tests/test_coordinator.py",),
    ),
    _depends(
        f"{_MR}._prepare_eager_forward_batch",
        "0.5.15: the eager forward's num_real_reqs.fill_(batch_size), which 0.5.13 "
        "did inline in _forward_raw",
        (f"{_COUNT}.fill_",),
        since="0.5.15.post1",
    ),
    _depends(
        f"{_GRAPH}.capture_one_batch_size",
        "fills num_real_reqs with the captured batch size; the graph keeps the "
        "address of num_real_reqs' tensor, so it must never be reallocated",
        (f"{_COUNT}.fill_",),
    ),
    _depends(
        f"{_GRAPH}.replay_prepare",
        "fills num_real_reqs with the unpadded batch size before each replay "
        "(rows past it are padding the kernel skips)",
        (f"{_COUNT}.fill_",),
    ),
    _depends(
        f"{_KV_MIXIN}.calculate_mla_kv_cache_dim",
        "DSA row width: 576 values (bf16: 1152 B), FP8 512 + 512/128*4 + 64*2 = 656 B; "
        "the host pool's item_bytes and doctor's kernel item bytes follow it",
        ("sglang_hisparse.doctor:row_bytes", "sglang_hisparse.pools.host:HiSparseMLAHostPool"),
        tests=("tests/test_host_pool.py", "tests/test_doctor.py"),
    ),
    # 0.5.17 moved pool construction into mem_cache/kv_cache_configurator.py
    # and the coordinator's construction out of alloc_memory_pool: what the
    # _init_pools and initialize entries relied on lives here there.
    _depends(
        f"{_MR}.maybe_init_hisparse_coordinator",
        "builds the target's coordinator after the pools (before the attention backend "
        "and graph capture) with the fixed keywords from parse_hisparse_config, "
        "top_k = the model's index_topk",
        (_COORD, "sglang_hisparse.adapter.args:parse_hisparse_config"),
        since="0.5.17",
    ),
    _depends(
        f"{_KV_CONFIGURATOR}._build_dsa_kv_pool",
        "with HiSparse the DSA pool is HiSparseDSATokenToKVPool (a class REPLACE target) "
        "with host_to_device_ratio from parse_hisparse_config",
        ("sglang_hisparse.pools.device_dsa:HiSparseDSADevicePool",
         "sglang_hisparse.adapter.args:parse_hisparse_config"),
        tests=("tests/test_device_pool.py",),
        since="0.5.17",
    ),
    _depends(
        f"{_KV_CONFIGURATOR}._build_token_to_kv_pool_allocator",
        "HiSparse: HiSparseTokenToKVPoolAllocator(size, page_size, dtype, device, kvcache, "
        "need_sort, host_to_device_ratio); DeepSeek-V4 wraps the SWA one in "
        "DeepSeekV4HiSparseTokenToKVPoolAllocator",
        (_ALLOC, "sglang_hisparse.pools.allocator_c4:DSV4HiSparseAllocator",
         "sglang_hisparse.adapter.args:parse_hisparse_config"),
        tests=("tests/test_allocator.py", "tests/test_dsv4.py"),
        since="0.5.17",
    ),
    _depends(
        f"{_DECODE}.alloc_for_decode_prealloc_hisparse",
        "PD prealloc, before the patched host-row call: sets req.kv (kv_allocated_len = "
        "fill_len), then alloc_logical_only (alloc_extend_swa_tail if offered: ours is not)",
        (f"{_ALLOC}.alloc_logical_only", f"{_COORD}.prealloc_host_rows"),
        tests=("tests/test_disaggregation.py", "tests/test_pd_node.py"),
        since="0.5.17",
    ),
    _depends(
        "sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator.__init__",
        "DeepSeek-V4 C4 pool shrink factor = parse_hisparse_config(...).host_to_device_ratio",
        (
            "sglang_hisparse.adapter.args:parse_hisparse_config",
            "sglang_hisparse.pools.allocator_c4:DSV4HiSparseAllocator",
        ),
        scope=Scope.ALWAYS,
    ),
    # --- the scheduler.
    _depends(
        f"{_SCHED}.__init__",
        "takes the coordinator from tp_worker.model_runner and calls "
        "set_decode_producer_stream(self.forward_stream)",
        (f"{_COORD}.set_decode_producer_stream",),
    ),
    _depends(
        f"{_SCHED}.release_host_resources",
        "0.5.15: graceful shutdown calls the coordinator's destroy() (drain the "
        "side streams, release the pinned host pool)",
        (f"{_COORD}.destroy",),
        since="0.5.15.post1",
    ),
    _depends(
        f"{_SCHED}.is_fully_idle",
        "the scheduler is not idle while has_ongoing_staging()",
        (f"{_COORD}.has_ongoing_staging",),
    ),
    _depends(
        f"{_SCHED}._get_new_batch_prefill_raw",
        "PrefillAdder built with new_token_ratio_tracker.current and "
        "self.chunked_prefill_size; the chunked request first, then the waiting "
        "queue in policy order unless batch_is_full",
        (_DEMAND, _STREAMING_HOOK),
        tests=("tests/test_parking.py", "tests/test_streaming.py"),
    ),
    _depends(
        f"{_ADDER}._get_running_request_total_token_offset",
        "a running request costs min(max_new_tokens - outputs, CLIP_MAX_NEW_TOKENS) "
        "* new_token_ratio",
        (_DEMAND, _GROWTH_ON_HOST),
        tests=("tests/test_parking.py", "tests/test_prefill_adder.py"),
    ),
    _depends(
        f"{_ADDER}._update_prefill_budget",
        "an admitted prompt adds input + clipped output + page to "
        "rem_total_token_offset and input + page (no output) to cur_rem_token_offset",
        (_ADD_ONE_REQ_HOOK,),
        tests=("tests/test_prefill_adder.py",),
    ),
    _depends(
        f"{_ADDER}.add_chunked_req",
        "the chunked request's next chunk is at most rem_chunk_tokens (the "
        "streaming cap)",
        (_STREAMING_HOOK,),
        tests=("tests/test_streaming.py",),
    ),
    _depends(
        f"{_ADDER}.rem_total_tokens",
        "admission budget = allocator available_size() + evictable - offset",
        (_DEMAND, f"{_ALLOC}.available_size", _GROWTH_ON_HOST, _IGNORE_EOS_HOOK, _ADD_ONE_REQ_HOOK),
        tests=("tests/test_parking.py", "tests/test_allocator.py", "tests/test_prefill_adder.py"),
    ),
    _depends(
        f"{_ADDER}.cur_rem_tokens",
        "the per-batch budget reads allocator available_size() the same way",
        (f"{_ALLOC}.available_size", _IGNORE_EOS_HOOK, _ADD_ONE_REQ_HOOK),
        tests=("tests/test_allocator.py", "tests/test_prefill_adder.py"),
    ),
    # --- batches: decode preparation, retraction.
    _depends(
        f"{_BATCH}.prepare_for_decode",
        "after alloc_for_decode and seq_lens += 1 calls map_last_loc_to_buffer(seq_lens, "
        "out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu)",
        (f"{_COORD}.map_last_loc_to_buffer",),
    ),
    _depends(
        f"{_BATCH}.retract_decode",
        "the last request that still does not fit gets to_finish = FINISH_ABORT "
        "before release_req, so retract_req releases it whole",
        (f"{_RETAIN}.retains",),
        tests=("tests/test_disaggregation.py",),
    ),
    _depends(
        f"{_REQ}.offload_kv_cache",
        "snapshots req_to_token[: seqlen - 1] through allocator.get_cpu_copy into "
        "req.kv_cache_cpu",
        (f"{_ALLOC}.get_cpu_copy", f"{_RETAIN}.retract_to_host", f"{_RETAIN}.take_retained"),
        tests=("tests/test_disaggregation.py",),
    ),
    _depends(
        "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool.get_cpu_copy",
        "the indexer's index_k_with_scale_buffer is indexed by page (location // page_size) "
        "and must go with a retracted request's KV: its pages are reused",
        ("sglang_hisparse.engine.retained_device_state:dsa_indexer_state",),
        tests=("tests/test_pd_node.py",),
    ),
    # DeepSeek-V4 on a PD decode node: what a retracted request's device state is.
    _depends(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool."
        "get_contiguous_buf_infos",
        "the device buffers besides the C4 KV: C4 indexer keys and C128 KV, one page per "
        "logical page",
        ("sglang_hisparse.engine.retained_device_state:dsv4_device_state",),
        tests=("tests/test_dsv4_retract.py",),
    ),
    _depends(
        "sglang.srt.mem_cache.deepseek_v4_compress_state.CompressStatePool."
        "translate_from_swa_loc_to_state_loc",
        "a compressor state holds ring_size rows per SWA page (swa_loc // swa_page_size)",
        ("sglang_hisparse.engine.retained_device_state:SwaPages",),
        tests=("tests/test_dsv4_retract.py",),
    ),
    _depends(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool."
        "clear_c128_req_state",
        "the C128 attention state is kept per request slot, ring_size rows a slot "
        "(its presence is how we tell)",
        ("sglang_hisparse.engine.retained_device_state:dsv4_device_state",),
        tests=("tests/test_dsv4_retract.py",),
        since="0.5.15.post1",
    ),
    _depends(
        f"{_REQ}.load_kv_cache",
        "hands kv_cache_cpu and req_to_token[: seqlen - 1] to allocator.load_cpu_copy, "
        "then drops kv_cache_cpu",
        (f"{_ALLOC}.load_cpu_copy", f"{_RETAIN}.restore_retained"),
        tests=("tests/test_disaggregation.py",),
    ),
    # --- mem_cache/common.py: allocation and release.
    _depends(
        f"{_COMMON}.alloc_paged_token_slots_extend",
        "evicts, takes backup_state() if asked, then alloc_extend(...); None raises "
        "'Prefill out of memory'",
        (f"{_ALLOC}.alloc_extend",),
        tests=("tests/test_allocator.py",),
    ),
    _depends(
        f"{_COMMON}.alloc_paged_token_slots_decode",
        "alloc_decode(seq_lens, seq_lens_cpu, last_loc); None raises 'Decode out of memory'",
        (f"{_ALLOC}.alloc_decode",),
        tests=("tests/test_allocator.py",),
    ),
    _depends(
        f"{_COMMON}.alloc_for_decode",
        "last_loc from req_to_token, alloc, then out_cache_loc written to "
        "req_to_token at seq_lens, before prepare_for_decode maps it",
        (_ALLOC, f"{_COORD}.map_last_loc_to_buffer"),
        tests=("tests/test_coordinator.py",),
    ),
    _depends(
        f"{_COMMON}.release_kv_cache",
        "cache_finished_req frees the request's logical KV, then the request slot; "
        "callers run request_finished first",
        (f"{_COORD}.request_finished", f"{_ALLOC}.free"),
        tests=("tests/test_coordinator.py", "tests/test_disaggregation.py"),
    ),
    _depends(
        "sglang.srt.mem_cache.chunk_cache.ChunkCache.cache_finished_req",
        "frees req_to_token[: kv_allocated_len] through allocator.free",
        (f"{_ALLOC}.free",),
        tests=("tests/test_disaggregation.py",),
    ),
    # --- batch results: admission and finish.
    _depends(
        f"{_BRP}.process_batch_result_prefill",
        "admit_request_into_staging after maybe_cache_unfinished_req for a request "
        "that did not finish at prefill; one that did only gets release_kv_cache",
        (f"{_COORD}.admit_request_into_staging",),
    ),
    _depends(
        f"{_BRP}.process_batch_result_decode",
        "frees of a decode step run between allocator free_group_begin/end, and the "
        "group ends after stream_output (a hot buffer's release waits for the end)",
        (f"{_ALLOC}.free", f"{_ALLOC}.release_after_group"),
    ),
    _depends(
        f"{_BRP}._handle_finish_state_updated_req",
        "a finished request gets request_finished before release_kv_cache (without "
        "decode KV offload)",
        (f"{_COORD}.request_finished",),
    ),
    _depends(
        f"{_BRP}.process_batch_result_prebuilt",
        "PD decode: a request finished in the prebuilt step gets request_finished "
        "before release_kv_cache",
        (f"{_COORD}.request_finished",),
    ),
    _depends(
        f"{_POOL_STATS}.get_pool_stats",
        "every branch builds a fresh PoolStats just before _get_hisparse_token_info",
        ("sglang_hisparse.adapter.metrics:pool_stats_with_hisparse",),
        tests=("tests/test_metrics.py",),
    ),
    # --- attention backends: the per-layer swap-in.
    _depends(
        f"{_DSA}.forward_decode",
        "the decode page table is swap_in_selected_pages(req_pool_indices, seq_lens, "
        "topk_indices padded to the q rows, layer_id)",
        (f"{_COORD}.swap_in_selected_pages",),
    ),
    # --- IndexShare (engine/index_share.py, engine/prefetch.py): which
    # layers run their indexer, and that a shared layer's swap-in gets the
    # previous anchor's top-k, layer after layer.
    _depends(
        "sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA.__init__",
        "skip_topk per layer: index_topk_pattern[layer_id] == 'S', else index_topk_freq / "
        "index_skip_topk_offset (0.5.13 inline; 0.5.15.post1 through dsa_layer_skips_topk); "
        "NextN layers always share",
        (_ROLES, _ROLE_RULES_0_5_13, _ROLE_RULES_0_5_15),
        tests=("tests/test_index_share.py",),
    ),
    _depends(
        "sglang.srt.configs.model_config.dsa_layer_skips_topk",
        "0.5.15: the skip_topk formula, a pattern shorter than the model leaves the layers "
        "past it anchors, index_topk_freq None is 1",
        (_ROLES, _ROLE_RULES_0_5_15),
        tests=("tests/test_index_share.py",),
        since="0.5.15.post1",
    ),
    _depends(
        "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla."
        "DeepseekMLAForwardMixin.forward_absorb_prepare",
        "a skip_topk layer runs no indexer and attends over prev_topk_indices (the previous "
        "layer's top-k), through the same backend call and so the same swap-in",
        (_PREFETCH, f"{_COORD}.swap_in_selected_pages"),
        tests=("tests/test_index_share.py",),
    ),
    _depends(
        "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla."
        "DeepseekMLAForwardMixin.should_run_indexer",
        "0.5.15: forward_absorb_prepare's gate, a skip_topk layer never runs its indexer "
        "(NextN without a carried top-k excepted)",
        (_PREFETCH,),
        tests=("tests/test_index_share.py",),
        since="0.5.15.post1",
    ),
    _depends(
        "sglang.srt.models.deepseek_v2.DeepseekV2Model.forward",
        "layers run in layer-id order, each handed the previous layer's top-k "
        "(prev_topk_indices=topk_indices): an anchor's shared layers run before the next anchor",
        (_PREFETCH,),
        tests=("tests/test_index_share.py",),
    ),
    _depends(
        "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer",
        "decode: top-k into raw_indices_buffer, then swap_in_selected_pages(keywords) "
        "per compress layer; otherwise the C4 pool's translate_loc_to_hisparse_device",
        (f"{_COORD}.swap_in_selected_pages", "sglang_hisparse.pools.device_c4:DSV4C4DevicePool"),
    ),
    _depends(
        "sglang.srt.layers.attention.dsv4.compressor_v2.CompressorBackendMixin.forward_unified",
        "the C4 compressor writes through the C4 pool's translate_loc_to_hisparse_device "
        "(found by hasattr) as int32 physical rows",
        ("sglang_hisparse.pools.device_c4:DSV4C4DevicePool.translate_loc_to_hisparse_device",),
        tests=("tests/test_dsv4.py",),
    ),
    # --- PD decode (disaggregation/decode.py, scheduler_pp_mixin.py).
    _depends(
        f"{_PREALLOC}._init_kv_manager",
        "transfers into coordinator.mem_pool_host's buffers (DSv4: device tail after its "
        "layers), DRAM for NIXL from 0.5.15; setup_state_kv_args gets the draft pool",
        (
            "sglang_hisparse.pools.host:HiSparseMLAHostPool",
            "sglang_hisparse.pools.host:HiSparseC4HostPool",
            _DRAFT_SWA,
            _HOST_BACKENDS_0_5_15,
        ),
        scope=Scope.ALWAYS,
    ),
    # --- the transfer backends a HiSparse decode may use (arg_rules: the
    # KV lands in host memory; adapter/releases: decode_host_transfer_backends).
    *(
        _depends(f"{_CONN}.{target}", why, relied_on_by, scope=Scope.ALWAYS, tests=(test,))
        for target, why, relied_on_by, test in (
            ("mooncake.conn.MooncakeKVManager.register_buffer_to_engine",
             "Mooncake registers the KV buffers as plain pointers (batch_register), "
             "wherever they live: the host pool is a valid target",
             (_HOST_BACKENDS_0_5_13,), "tests/test_pd_transfer.py"),
            ("nixl.conn.NixlKVManager.register_buffer_to_engine",
             "0.5.13 registers every KV buffer as VRAM (HiSparse decode refused with "
             "nixl); 0.5.15.post1 by kv_data_mem_kinds (DRAM for the host pool: accepted)",
             (_HOST_BACKENDS_0_5_13, _HOST_BACKENDS_0_5_15), "tests/test_arg_hooks.py"),
            ("mori.conn.MoriKVManager._register_local_buffers",
             "mori registers every KV buffer as MemoryLocationType.GPU (HiSparse decode "
             "refused with mori)",
             (_HOST_BACKENDS_0_5_13,), "tests/test_arg_hooks.py"),
        )
    ),
    # Patched up to 0.5.15.post1 (the device-tail pages, a hook entry above);
    # from 0.5.17, where that is native, still relied on unchanged: the same
    # target a second time, over releases the patch does not cover.
    _depends(
        f"{_PREALLOC}.pop_preallocated",
        "request budget = hisparse_attn_allocator.available_size() // "
        "padded_buffer_size - transfer queue; indices paged by hisparse_page_size; "
        "every SWA state gets the window's SWA pages",
        (f"{_ALLOC}.available_size", _COORD, _DRAFT_SWA),
        scope=Scope.ALWAYS,
        since="0.5.17",
    ),
    _depends(
        f"{_PREALLOC}._allocatable_token_budgets",
        "the PD token budget is logical_attn_allocator.available_size()",
        (f"{_ALLOC}.available_size",),
    ),
    _depends(
        f"{_PREALLOC}.resume_retracted_reqs",
        "resumes while the logical budget allows: _pre_alloc (new slot and host rows) "
        "before Req.load_kv_cache",
        (f"{_RETAIN}.restore_retained",),
        tests=("tests/test_disaggregation.py",),
    ),
    _depends(
        f"{_DECODE}.DecodeTransferQueue.pop_transferred",
        "a failed or corrupted transfer gets request_finished before release_kv_cache",
        (f"{_COORD}.request_finished",),
    ),
    _depends(
        f"{_DECODE_MIXIN}.process_decode_queue",
        "every transferred request gets admit_request_direct before it joins the "
        "waiting queue",
        (f"{_COORD}.admit_request_direct",),
    ),
    _depends(
        f"{_DECODE_MIXIN}.get_next_disagg_decode_batch_to_run",
        "a prebuilt batch that becomes the running batch gets hisparse_coordinator set "
        "(prepare_for_decode reads it)",
        (f"{_COORD}.map_last_loc_to_buffer",),
    ),
    # --- PD with a DeepSeek-V4 draft: what the draft's SWA component relies on.
    _draft_swa_depends(
        f"{_DISAGG_UTILS}.append_state_component",
        "appends one component (type, ptrs, lens, item lens, dims) to kv_args' parallel "
        "state lists; prefill and decode pair components by position",
        ("tests/test_dsv4_draft_swa.py",),
    ),
    _draft_swa_depends(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_state_buf_infos",
        "state buffers: the SWA pool's per-layer page buffers, then the compress states "
        "(none for an SWA-only draft)",
        ("tests/test_dsv4_draft_swa.py",),
    ),
    _draft_swa_depends(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
        "prefill: setup_state_kv_args(kv_args, target pool, draft pool, ...) once, before "
        "the KV manager is built",
    ),
    _draft_swa_depends(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk",
        "prefill: every SWA state component gets the window's SWA pages through the "
        "target's translate_loc_from_full_to_swa",
    ),
    _draft_swa_depends(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.maybe_send_extra",
        "Mooncake sends every SWA state component page by page with its own pointers and "
        "item lengths",
    ),
    _draft_swa_depends(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager.maybe_send_extra",
        "NIXL sends every SWA state component page by page with its own pointers and item "
        "lengths",
    ),
    _depends(
        "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin.process_decode_transfer_queue",
        "PP decode: every released request gets admit_request_direct before it joins "
        "the waiting queue",
        (f"{_COORD}.admit_request_direct",),
    ),
)

ENTRIES: tuple[Entry, ...] = HOOKS + DEPENDS


def entries_for(native_only: bool) -> tuple[Entry, ...]:
    """What one mode installs and checks: ours (ALWAYS + DATA_PLANE) or the
    native comparison (ALWAYS + NATIVE)."""
    skip = Scope.DATA_PLANE if native_only else Scope.NATIVE
    return tuple(e for e in ENTRIES if e.scope is not skip)


def entries_of(version: str, entries: tuple[Entry, ...] = ENTRIES) -> tuple[Entry, ...]:
    """The entries whose target the release ``version`` has."""
    return tuple(e for e in entries if e.applies_to(version))
