"""Every place where sglang-hisparse touches SGLang, as data.

Each :class:`Entry` says what is changed (``target``), how (``kind``), which
exact source it was written against (``sha256`` per SGLang release), why, and
when upstream made it unnecessary (``native_in``). The loader refuses to
activate anything unless every entry checks out against the installed SGLang;
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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Kind(str, enum.Enum):
    BEFORE = "BEFORE"
    AFTER = "AFTER"
    AROUND = "AROUND"
    REPLACE = "REPLACE"
    PROPERTY = "PROPERTY"
    SOURCE_PATCH = "SOURCE_PATCH"


class Scope(str, enum.Enum):
    # Always applied: argument handling and fixes that SGLang's own HiSparse
    # also needs (they keep the "native" comparison mode usable).
    ALWAYS = "always"
    # Our data plane (coordinator, allocator, pools, kernels). Skipped when
    # SGLANG_HISPARSE_NATIVE=1 asks for SGLang's own HiSparse with fixes only.
    DATA_PLANE = "data_plane"


@dataclass(frozen=True)
class Entry:
    target: str
    kind: Kind
    sha256: dict[str, str]  # SGLang version -> sha256 of the target's source
    why: str
    native_in: str | None  # upstream release where the behaviour became native
    impl: str | None = None  # "module:attr" of our hook; None for SOURCE_PATCH
    upstream: str = ""  # where upstream did it (release file:line, PR)
    scope: Scope = Scope.ALWAYS
    removal: str = ""  # what to do with this entry once the pin passes native_in

    @property
    def name(self) -> str:
        return self.target.removeprefix("sglang.srt.")


_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_HISPARSE_HOOK = "sglang.srt.arg_groups.hisparse_hook"
_FACTORY = "sglang.srt.mem_cache.sparsity.factory"

ENTRIES: tuple[Entry, ...] = (
    Entry(
        target=f"{_SCHED}._build_hisparse_decode_batch",
        kind=Kind.SOURCE_PATCH,
        sha256={"0.5.13": "7c899bd9aeef7487132b4a4d01dc802c971bb059244ad468bb4c93128ac6c352"},
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
    ),
    Entry(
        target=f"{_HISPARSE_HOOK}.validate_hisparse",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "3e02dbb17e53162f30d19c6c530ed1a55e4da4709d2081fbe652f8b148f7e625"},
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
        impl="sglang_hisparse.arg_hooks.validation:validate_hisparse",
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
    ),
    Entry(
        target=f"{_HISPARSE_HOOK}.apply_hisparse_dsa_backend_defaults",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "3aecab7831a2e57a782c3ff4413d8a16c3de26bc5119049d67361a1a04e986ce"},
        why=(
            "Same defaults as 0.5.13 (bfloat16 -> flashmla_sparse, fp8_e4m3 -> "
            "flashmla_kv). Replaced so the backend we default to and the backend "
            "validate_hisparse accepts come from one table "
            "(sglang_hisparse.arg_hooks.backends) and cannot drift apart."
        ),
        # The defaults themselves are native; the entry lives as long as our
        # validate_hisparse does, so it is not dropped by release.
        native_in=None,
        impl="sglang_hisparse.arg_hooks.backends:apply_hisparse_dsa_backend_defaults",
        upstream=(
            "0.5.13 srt/arg_groups/hisparse_hook.py:23-46; 0.5.23 moved it into "
            "arg_groups/overrides.py:_dsa_split_backend_resolution (677-706)"
        ),
        removal=(
            "droppable together with our validate_hisparse only; while that is "
            "ours, keep this so both read backends.DSA_BACKEND_BY_KV_CACHE_DTYPE"
        ),
    ),
    Entry(
        target=f"{_FACTORY}.parse_hisparse_config",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "be442b0734f70694cf93a059ba0ebd09668cc0d4e57aa014bc25a928c7e33970"},
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
        impl="sglang_hisparse.arg_hooks.sparse_config:parse_hisparse_config",
        upstream=(
            "0.5.23 srt/mem_cache/sparsity/factory.py:62-117 (adds "
            "swap_in_block_size, still no key or type checks; no server_args "
            "parameter from 0.5.19)"
        ),
        removal=(
            "keep; on a pin >= 0.5.19 the signature is parse_hisparse_config() "
            "and our replacement must read get_memory() instead of server_args"
        ),
    ),
    # --- data plane (issue 3): our allocator / coordinator replace the native ones.
    Entry(
        target="sglang.srt.mem_cache.hisparse_memory_pool.HiSparseTokenToKVPoolAllocator",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "8afb746e4d624c2ef5a5840ef918e6d965f8e47ee5f83178f8d34c6ade553593"},
        why=(
            "Dual logical/physical allocator whose available_size() holds back the "
            "hot-buffer growth, newest-token page and host rows live requests still "
            "need (0.5.13 admits work the host pool cannot back: sglang#23704); "
            "page_size 1 decode; exposes the logical capacity; on a PD decode node "
            "hands retraction snapshots over as host rows (0.5.13 raises: sglang#40729)."
        ),
        native_in=None,
        impl="sglang_hisparse.allocator:HiSparseDualAllocator",
        upstream="0.5.23 srt/mem_cache/allocator/hisparse.py:22-299",
        scope=Scope.DATA_PLANE,
        removal="keep: admission accounting is not upstream",
    ),
    Entry(
        target="sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "a9821b2028569b6f03269aa8041fd57aba0645f70d40e0fb0913dd5040e640f4"},
        why=(
            "The last native HiSparse class on the DSA data path: the GPU pool whose "
            "latent KV is indexed by physical rows (mapping registered by our "
            "allocator) while the indexer K cache spans the logical space. Ours "
            "keeps 0.5.13's buffers and translation exactly (-1 padding stays -1) "
            "and fails with a clear error when used before a mapping is registered "
            "or asked for a retraction snapshot."
        ),
        native_in=None,
        impl="sglang_hisparse.device_pool:HiSparseDSADevicePool",
        upstream=(
            "0.5.13 srt/mem_cache/hisparse_memory_pool.py:38-132 (the class we "
            "replace); later releases not re-checked for this entry"
        ),
        scope=Scope.DATA_PLANE,
        removal="keep while the data plane is ours",
    ),
    Entry(
        target="sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "3f51fc958a70e5c7f4454e9d48f9c503f963d018b34887423b046dbb4e6b0b8f"},
        why=(
            "Our coordinator: host-wait instead of a crash when the host pool is "
            "exhausted, idempotent release in every state, swap-in through "
            "sglang_hisparse.kernels, hit/miss/byte counters, destroy(); a request "
            "retracted on a PD decode node keeps its KV on host and resumes from it."
        ),
        native_in=None,
        impl="sglang_hisparse.coordinator:HiSparseCoordinator",
        upstream="0.5.23 srt/managers/hisparse_coordinator.py:533-1637",
        scope=Scope.DATA_PLANE,
        removal="keep while the data plane is ours",
    ),
    Entry(
        target="sglang.srt.model_executor.model_runner.ModelRunner.max_token_pool_size",
        kind=Kind.PROPERTY,
        sha256={"0.5.13": "0fed3db012ceee0db596df8aeaf9f046d2f5424ad57b95b098419492da563c7e"},
        why=(
            "0.5.13 caps the max request length at the GPU pool; with HiSparse the "
            "host-backed logical space is the limit."
        ),
        native_in="0.5.19",
        impl="sglang_hisparse.hooks:model_runner_max_token_pool_size",
        upstream="0.5.23 srt/model_executor/model_runner.py:1516-1524",
        scope=Scope.DATA_PLANE,
        removal="drop on a pin >= 0.5.19 (logical max-req-len is native)",
    ),
    Entry(
        target=f"{_SCHED}.abort_request",
        kind=Kind.AROUND,
        sha256={"0.5.13": "973c6e8ac3b7e869a6f0aacba300954c4a6a34309b8ae76e1d84153afa872ec0"},
        why=(
            "0.5.13 leaks the hot buffer and host rows of an aborted PD-decode "
            "waiting-queue request (and, with our retraction, the host rows a "
            "retracted request keeps) and loses aborts of requests still staging."
        ),
        native_in=None,
        impl="sglang_hisparse.hooks:scheduler_abort_request",
        upstream="0.5.23 srt/managers/scheduler.py:5708-5709 (PD waiting queue only)",
        scope=Scope.DATA_PLANE,
        removal="keep the staging part; the PD part is native from 0.5.22",
    ),
    Entry(
        target=f"{_SCHED}.get_next_batch_to_run",
        kind=Kind.AROUND,
        sha256={"0.5.13": "d197e43e29d9c0b0938065419219defbff416b248216a817f7681d0323652ea2"},
        why=(
            "Parking needs the scheduler's pending prefill work (waiting queue, "
            "chunked request, running batch) where collect_ready_reqs runs: a "
            "staged request then waits on host instead of taking a hot buffer a "
            "waiting prompt needs, so the batch is bounded by hot buffers, not "
            "by prefill rows."
        ),
        native_in=None,
        impl="sglang_hisparse.hooks:scheduler_get_next_batch_to_run",
        upstream="none: 0.5.23 joins every staged request at once (srt/managers/scheduler.py:3923)",
        scope=Scope.DATA_PLANE,
        removal="keep while the data plane is ours",
    ),
    Entry(
        target=(
            "sglang.srt.managers.scheduler_components.pool_stats_observer."
            "PoolStats.get_decode_usage_msg_parts"
        ),
        kind=Kind.AFTER,
        sha256={"0.5.13": "30094ce30421695185588626cfdc9a84cce5e029a551e97b98fdc22cce9e818e"},
        why=(
            "The decode log line shows only token counts; users need the hit rate, "
            "misses and host traffic to size the hot buffer. The same reading feeds "
            "Prometheus counters under --enable-metrics (0.5.13 exports none)."
        ),
        native_in=None,
        impl="sglang_hisparse.metrics:decode_usage_msg_parts",
        upstream="none: 0.5.23 logs token counts only (pool_stats_observer.py:138-143)",
        scope=Scope.DATA_PLANE,
        removal="keep",
    ),
    Entry(
        target=(
            "sglang.srt.managers.scheduler_components.pool_stats_observer."
            "SchedulerPoolStatsObserver._get_hisparse_token_info"
        ),
        kind=Kind.REPLACE,
        sha256={"0.5.13": "cc63fb010bd7bfdfd0ae688bf20eb26271040a6718b2fec1c2da5ff1b3dcbf9d"},
        why=(
            "SGLang reads pool stats for every streamed output, i.e. every decode "
            "step, and 0.5.13 adds the HiSparse fields with dataclasses.replace, a "
            "full copy of a 19-field PoolStats; ours sets the same fields on the "
            "fresh PoolStats get_pool_stats just built (a lone request's step is "
            "scheduler CPU on small models)."
        ),
        native_in=None,
        impl="sglang_hisparse.metrics:pool_stats_with_hisparse",
        upstream="none: 0.5.23 still copies (pool_stats_observer.py:248-259)",
        scope=Scope.DATA_PLANE,
        removal="keep while the copy is upstream; drop if get_pool_stats stops building fresh stats",
    ),
    # --- data plane, DeepSeek-V4 (C4 layers): allocator and C4 device pool.
    Entry(
        target="sglang.srt.mem_cache.hisparse_memory_pool.DeepSeekV4HiSparseTokenToKVPoolAllocator",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "8f3a6d742c489b80317cecd0140d3136fd215548de4245550698aded197128b8"},
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
        native_in=None,
        impl="sglang_hisparse.dsv4:DSV4HiSparseAllocator",
        upstream="0.5.23 srt/mem_cache/allocator/hisparse.py:302-670",
        scope=Scope.DATA_PLANE,
        removal="keep while the data plane is ours",
    ),
    Entry(
        target="sglang.srt.mem_cache.deepseek_v4_memory_pool.HiSparseC4DevicePool",
        kind=Kind.REPLACE,
        sha256={"0.5.13": "68fa0abfac4eadd75a1ed0f9a66bb365d5179a66ce1644fd7b0e8ca59eaf9655"},
        why=(
            "The last native HiSparse class on the DeepSeek-V4 path: the C4 pool "
            "that translates compressed write locations to hot-buffer rows through "
            "the mapping our DSV4 allocator registers. Same buffers, data_ptrs and "
            "translation as 0.5.13; replaced so the whole C4 data plane is ours."
        ),
        native_in=None,
        impl="sglang_hisparse.dsv4:DSV4C4DevicePool",
        upstream="0.5.23 srt/mem_cache/deepseek_v4_memory_pool.py:437-527",
        scope=Scope.DATA_PLANE,
        removal="keep while the data plane is ours",
    ),
)


def entries_for(native_only: bool) -> tuple[Entry, ...]:
    if native_only:
        return tuple(e for e in ENTRIES if e.scope is Scope.ALWAYS)
    return ENTRIES
