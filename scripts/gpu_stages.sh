#!/usr/bin/env bash
# One device command for the lent H200, in stages: GPU tests, before/after
# e2e timing, the exactness check on the tiny model, a planted fault the
# check must catch, the check on a 61-layer DeepSeek-V3.2-geometry model, and
# the realistic-scale figures (the synthetic top-k on the GPU, the decode-only
# step and its breakdown at 32K contexts, a decode-bound end to end).
#
# BEFORE THE DEVICE RUN, here (network; from the repo root):
#   bash .gpu/build_bundle.sh                       # .bundle/site.tar.xz.* (kit)
#   .venv/bin/python -m pip download --no-deps -d .bundle/wheels \
#       pytest-xdist==3.6.1 execnet==2.1.1           # for the tests stage
#   # the "before" package (configuration ref of e2e_gpu.py), from git 1eebd12:
#   rm -rf /tmp/ref-1eebd12 .bundle/ref_pkg && mkdir -p /tmp/ref-1eebd12 \
#     && git archive 1eebd12 | tar -x -C /tmp/ref-1eebd12 \
#     && .venv/bin/python -m pip install -q --no-deps --no-compile \
#          --target .bundle/ref_pkg /tmp/ref-1eebd12 \
#     && git rev-parse 1eebd12 > .bundle/ref_pkg/REF_COMMIT
#   (build isolation fetches setuptools+wheel; the venv itself has no
#   `wheel`, so --no-build-isolation fails here. ~0.9 MB.)
#   bash scripts/pack_mooncake.sh                  # .bundle/mooncake.tar.xz (6.4 MiB), for pd
#   bash scripts/pack_dsv4.sh                      # .bundle/dsv4.tar.xz (~26 MB), for dsv4:
#                                                  # it does not fit one call beside the kit,
#                                                  # see the dsv4 stage below
#   Optional: a JIT cache brought back by the `jit` stage:
#   cat jitcache.tar.xz.* > .bundle/jitcache.tar.xz  (counts toward the
#   64 MiB that travels: the kit's bundle is ~45 MB of it). With the
#   tracked tree at ~21 MB (2026-12-07) the two no longer travel together:
#   carry [".bundle/site.tar.xz.00", ".gpu"] for `source .gpu/device_env.sh`
#   (it unpacks the site once per machine), then at once, on the warm
#   machine, [".bundle/jitcache.tar.xz", ".gpu"] for the stages.
#
# ON THE DEVICE, from the repo root, carry [".bundle", ".gpu"]:
#   bash scripts/gpu_stages.sh STAGE...
# Stages run in the order given; each has its own `timeout`, and the whole
# command keeps within GF_BUDGET_S (default 570 s, the device allows 600):
# a stage that no longer fits is skipped and says so. Estimates, on a fresh
# machine without a JIT cache ("cold": the first server request of a command
# spends ~2.3 min building tvm-ffi/deep_gemm/triton/flashinfer kernels;
# later launches in the same command reuse them):
#   tests     GPU tests in 8 pytest-xdist workers: tests/test_kernel_gpu.py,
#             tests/test_host_memory_gpu.py, tests/test_exactness_kernel_gpu.py
#             (those present) and tests/test_soak.py::test_soak_on_gpu.
#             ~3-4 min (nvcc builds dominate; 53 tests took 2 min 35 s).
#   bg-tests  the same in the background, next to the stages after it; the
#             next timing stage (e2e*) and the end of the command wait for
#             it. Use it beside check/fault/deep only (they time nothing).
#   check     tiny model, ours with --check (SGLANG_HISPARSE_CHECK=1), the
#             concurrent workload (16 x 9000-token prompts, hot buffer 4096:
#             host misses); must report checked > 0 and no mismatch.
#             1 launch: ~1.5 min warm, ~4 min cold.
#   fault     the same with SGLANG_HISPARSE_SKIP_IO=1 (config noio: host
#             copies skipped), which the check must report as mismatches.
#             ~1.5 min warm, ~4 min cold.
#   e2e1      timing round 1: base, ref, ours on capacity + lone (one launch
#             each, both workloads per launch, --cpu-probe). ~4.5 min warm,
#             ~6.5 min cold.
#   e2e2      timing round 2, in the opposite order (ours, ref, base). Same.
#             Both rounds in one command are merged there; across commands
#             merge here: python3 scripts/e2e_gpu.py --merge \
#               e2e_round1.json e2e_round2.json --out e2e_merged.json
#   e2e       both rounds as one e2e_gpu.py --repeats 2 call (6 launches,
#             alternating): ~9 min warm, over 10 min cold. Prefer e2e1/e2e2.
#   deep      scripts/model_config.py --geometry v32 --layers 61 (random
#             weights, 31 GB bf16, --load-format dummy), ours with --check on
#             4 x 12000-token prompts x 64 tokens, --max-total-tokens 60000,
#             --mem-fraction-static 0.45, host_to_device_ratio 2 (~9 GiB
#             pinned). ~3-4 min warm (launch: weights, graphs up to batch 4),
#             +2 min cold.
#   trace     the synthetic top-k (SGLANG_HISPARSE_SYNTHETIC_TOPK) on the
#             GPU: its tests (kernel == torch version, calibration through
#             the kernel) and bench_kernels.py --trace (the kernel's miss
#             rate at 16K/32K/64K beside the reference's). ~1 min.
#   decode    decode-only step and where it goes, on the V3.2 geometry
#             (GF_DECODE_LAYERS, default 61): scripts/profile_decode.py,
#             32000-token prompts x GF_DECODE_NEW (400) out,
#             --max-total-tokens GF_DECODE_TOKENS (72000), GF_DECODE_CONFIGS
#             (base:2,ours:16: requests each; base holds two), synthetic
#             GF_DECODE_SYNTHETIC (calibrated; "" for the model's own
#             top-k); profiles 8 steps once all run (or
#             once the running count stops growing: native holds ~10), and
#             reads the decode-only rate from the server log. Measured at
#             61 layers: base ready in 81 s, then ~30 s; ours ready in 113 s,
#             then 16 prefills at ~7.3K tokens/s (~70 s) before all run:
#             give it a command of its own. With native (base:2,native:16,
#             ours:16) a request must outlast the others' prefills
#             (GF_DECODE_NEW=3000 at ~28 ms a step), and GF_DECODE_END=5
#             stops each server 5 s after its trace instead of decoding
#             every request to its end. On an H100 (80 GB) the 31 GB of
#             weights leave 61120 tokens at 0.45 (2026-12-07-s6: base then
#             holds 1): GF_DECODE_MEM=0.5 gives base and native 72000, ours
#             66880 (2026-12-07-s7). GF_DECODE_PLATEAU (s, default 20):
#             native admitted its 32K prompts 20-28 s apart at 61 layers
#             (0.5.13's ignore_eos admission waits until the oldest running
#             request is near its end: 2026-12-07-s7's README), so 20 s can
#             call a plateau that is not one.
#             The pool sets ours / native: native prefills a prompt into
#             device rows, so it runs (pool - prompt) / hot + 1 requests,
#             ours pool / hot (hot = 4160 rows): 10 and 16 at 72000
#             (2026-12-07-s7). GF_DECODE_TOKENS=50000 (base holds 1) gave
#             5 and 12 (2026-12-07-s8). There the same ignore_eos
#             admission keeps native at 5 only while its oldest request has
#             under 271 tokens left (66 of its 963 pure decode lines), and
#             admitting the next prompt whenever one ends keeps restarting
#             the plateau: GF_DECODE_JOIN (s, default 300) ends the wait for
#             the running count sooner (-s8: native GF_DECODE_PLATEAU=300
#             GF_DECODE_JOIN=130, 221 s; ours PLATEAU=20, 175 s; base
#             PLATEAU=15 JOIN=60, 84 s; GF_BUDGET_S must also cover ~75 s
#             of set-up, reserve and stop grace). A configuration may carry
#             its own waits, so several share one command's set-up:
#             GF_DECODE_CONFIGS=ours:16:plateau=20:join=200,base:2:plateau=15:join=60
#             (~260 s of stage, GF_BUDGET_S ~340; all three with native
#             took 460 s of the 510 s a 590 s budget leaves, 2026-12-07-s11).
#   bound     end to end, decode-bound (issue #16's targets, "#16 target"
#             lines): GF_BOUND_WORKLOADS (decodebound: 16 x 32K x 1024 out,
#             and lone32k: one 32K request, both at --max-total-tokens 72000,
#             one launch) on GF_BOUND_LAYERS (8) layers of the V3.2
#             geometry, configs GF_BOUND_CONFIGS (base,native,ours,noio; nores
#             for a lone request with host IO), synthetic GF_DECODE_SYNTHETIC
#             (calibrated; "" for the random weights' own top-k),
#             GF_BOUND_NEW output tokens instead of the workloads' (e.g.
#             2048), one launch each; GF_BOUND_TOGETHER=1: the configs'
#             servers start at once and take turns, GF_BOUND_INNER rounds
#             (GF_MEM_FRACTION 0.8 for five or six servers at once);
#             GF_BOUND_SERVER_ARGS: more server flags for every config
#             (e.g. "--chunked-prefill-size 2048" for the gaps);
#             GF_BOUND_EXTRA: more e2e_gpu.py flags, e.g. --check (the
#             in-server exactness check on ours-like configs: issue #16's
#             exactness item on these workloads; it compares every
#             resolved row with its authoritative copy after each layer's
#             swap-in, so a checked launch times nothing) or --step-timer
#             (with STEPTIMER_SYNCS=1 exported: the stacks of the
#             scheduler's synchronizing CUDA calls, in
#             LOGS/steptimer_*/; with STEPTIMER_TIMELINE=1: each batch,
#             stream_output, join, staging hand-over and finish stamped,
#             timeline_*.jsonl there, to read against the client's stamps
#             with scripts/gap_timeline.py). Run either apart from the
#             timing rounds. --freeze-gc: every server's collector frozen
#             after the warm-up (SGLang's advice; 2026-12-07-s11: the one
#             hold run over the gap target had a 0.72 s collection in the
#             tokenizer manager), timed rounds included.
#             decodelong (4096 out, its own launch): a round of base,
#             native, ours and noio should take ~240 s on 8 layers (base
#             ~110 s of it, estimated from 2048 out), ~390 s at
#             GF_BOUND_NEW=8192: one round per command. 2026-12-06-s4:
#             decodebound + lone32k at 2048 out, five configs, ~200 s a
#             round after ~60 s of warm start-up; a cold machine adds
#             ~115 s of kernel builds to the first server's start.
#   stream    the streaming policy on and off, side by side (tiny model):
#             configs GF_STREAM_CONFIGS (stream,ours,base; stream512: a
#             512-token prefill cap beside stream's 1024), workload
#             GF_STREAM_WORKLOAD (decodebound: 16 x 32K x 1024 out at
#             --max-total-tokens 72000), one launch each; the gap table's
#             "worst gap / own median" is the target (<= 10 for stream).
#             GF_STREAM_TOGETHER=1: the configs' servers start at once and
#             take turns (e2e_gpu.py --together, GF_STREAM_INNER rounds):
#             one start-up for all, which a cold machine needs (~190 s).
#             ~1.5-2 min per launch warm.
#   kbench    the swap-in kernel alone (waits for bg-tests): bench_kernels.py
#             --quick (ours vs the gather floor and 0.5.13's, batch 1/32, miss
#             0/13/100%) and --verify 2,4 (speculative verify rows: the union
#             call per layer beside the gather floor and the decode call);
#             GF_KBENCH picks tables (decode verify; overlap: --overlap, the
#             IndexShare prefetch replay beside compute per replay grid;
#             GF_OVERLAP_GRIDS=GRID,.. names the grids, bench_kernels' sweep
#             otherwise). ~2 min cold (nvcc builds), ~1 min warm.
#   mtp       MTP (EAGLE) with HiSparse, one launch after the other
#             (mtpproof runs the whole matrix at once), the kit model given a
#             NextN layer, --mtp GF_MTP (1,1,2: steps, top-k, draft tokens),
#             --hisparse-config GF_MTP_HS if set (4 draft tokens need a hot
#             buffer of >= 4 x 2048), two e2e_gpu.py calls:
#             1. configs GF_MTP_CONFIGS (base,ours: ours keeps requests
#             resident while rows allow) on GF_MTP_WORKLOADS (smoke) with
#             --check: logprobs vs base, the check's counters and the
#             speculative parity table (spec_verify_ct per request vs base);
#             2. configs GF_MTP_DRAIN_CONFIGS (nograph: ours without CUDA
#             graphs; empty: skipped) on the drain workload with --check: 8 x
#             9000 tokens at --max-total-tokens 30000 (residents demoted),
#             forced retraction, 4 aborts mid-decode, then a probe whose
#             decode log lines must show the pools back (the "drain" line).
#             3 launches, capped at GF_MTP_CAP_S (510 s): ~8 min cold.
#   mtpproof  MTP's exactness proof (issue #17) in one launch's time: six
#             e2e_gpu.py calls at once, each --parallel --check --warmup 0
#             (every server on its own port; host_to_device_ratio 2), the
#             kit model given a NextN layer:
#               a112   --mtp 1,1,2, B 4096, smoke at --max-total-tokens 40000:
#                      base, base2 (a second base: the control), plain (base
#                      without MTP), ours, nores, nograph
#               d112   --mtp 1,1,2, B 4096, drain: ours, nopark, nograph
#               a314   --mtp 3,1,4, B 8192, smoke as a112: base, ours, nores
#               s2, s3 the same with SGLANG_SIMULATE_ACC_LEN 2 and 3: base, nores
#                      (s3: also base2 and ours)
#               d314   --mtp 3,1,4, B 8192, drain: ours
#             19 servers; prints each call's tables (logprobs vs base and vs
#             plain, identical requests, the check, the parity, the drains).
#             GF_MTPPROOF (a112,d112,a314,s2,s3,d314) picks calls. Needs warm
#             kernel caches (19 servers building them at once would take the
#             machine's cores for minutes): run it after a stage that served
#             MTP on this machine, e.g. `mtp`, or with a carried JIT cache.
#             2026-12-04-s3: 16 servers in 140 s, warm.
#   mtpperf   MTP performance targets (no check): configs GF_MTP_PERF_CONFIGS
#             (base,ours) on capacity + lone (one launch each, warm-up run
#             first, --cpu-probe), GF_MTP_PERF_REPEATS (1) rounds; prints the
#             "mtp target" lines: lone TPOT ours/base (<= 1.05, ours
#             resident) and capacity tok/s ours/base (>= 2). ~7 min cold.
#             GF_MTP_PERF_WORKLOADS (capacity,lone); GF_MTP_PERF_EXTRA: more
#             e2e_gpu.py flags, e.g. "--step-profile" to see where a step's
#             time goes (with STEPTIMER_SYNCS=1 exported: the stacks of its
#             synchronizing CUDA calls, in LOGS/steptimer_*/).
#             Run it again with GF_MTP_PERF_CONFIGS=ours,base (opposite
#             order) and merge here: python3 scripts/e2e_gpu.py --merge
#             mtpperf_a.json mtpperf_b.json --out mtpperf.json
#   mtpprof   where an MTP step's time goes: scripts/profile_decode.py --mtp
#             GF_MTP (1,1,2) on the kit model, configs GF_MTPPROF_CONFIGS
#             (base,ours: the lone request of mtpperf, 16000-token prompt at
#             --max-total-tokens 40000; NAME:N sends N requests), 12 steps under
#             the server's torch profiler, GPU kernels per step side by side.
#             ~3 min warm.
#   pd        PD disaggregation (issue #18): scripts/pd_gpu.py on the kit model,
#             Mooncake from .bundle/mooncake.tar.xz (scripts/pack_mooncake.sh,
#             here; unpacked by scripts/mooncake_env.sh): a prefill server,
#             HiSparse and plain decode servers over mooncake_tcp, a router,
#             a colocated baseline, all launched together; parts GF_PD_PARTS
#             (exact,retract,faults,capacity): exactness + --check + the fake
#             control, PD retraction (forced; under host pressure), faults
#             (abort in flight, prompt too long, prefill killed), decode-node
#             capacity (decode-only tok/s, HiSparse / plain at 72000 tokens).
#             Parts that no longer fit the stage's time are skipped and say
#             so. ~2 min of launches, then ~5 min warm; run it as
#             `pd jit` in a command of its own. GF_PD_PARTS=v4draft (#19
#             item 4, not run yet): DeepSeek-V4 + EAGLE on both sides,
#             our pair and a stock pair (0.5.13's registration alone), each
#             side probed by scripts/draftprobe: the decode's draft SWA window
#             must equal the prefill's in ours and differ in stock. Needs
#             the V4 tarball unpacked first (the dsv4 stage's first call)
#             and Mooncake: two calls on one warm machine (the V4 tarball,
#             Mooncake's and the JIT cache; then the kit). GF_PD_PARTS=v4hs
#             (#19 item 4, not run yet): DeepSeek-V4 with HiSparse on the
#             decode node, forced retraction and the check, against a
#             colocated V4; the same carries. GF_PD_SERVER_ARGS: flags for
#             every server (both V4 parts at once are eight servers: give
#             them "--mem-fraction-static 0.6" on an 80 GB card).
#   indexshare  IndexShare prefetch (#20): its GPU tests
#             (tests/test_index_share_gpu.py and the copy-only kernel's
#             replay test) in the background while e2e_gpu.py serves the kit
#             model given index_topk_pattern GF_INDEX_PATTERN (FSSS; e.g.
#             FSFS; several, comma-separated, are one e2e_gpu.py call each,
#             at once under GF_PARALLEL=1 with the check, and PATTERN@N
#             serves the V3.2 geometry with N layers, e.g.
#             FSSS,FSFS,glm52@12) with configs GF_INDEXSHARE_CONFIGS (base,ours,sync,noio:
#             ours prefetches, sync has SGLANG_HISPARSE_INDEXSHARE_PREFETCH=0,
#             noio SGLANG_HISPARSE_SKIP_IO=1; also warp) on GF_INDEXSHARE_WORKLOADS
#             (capacity: host IO), --check unless GF_INDEXSHARE_CHECK=0
#             (ours and sync must be exact, noio caught; logprobs vs base),
#             GF_INDEXSHARE_REPEATS (1) rounds. Prints the IndexShare line:
#             ours/noio tok/s and the share of the sync-noio TPOT gap closed.
#             For timing run it again with GF_INDEXSHARE_CHECK=0
#             GF_INDEXSHARE_TESTS=0 (the check and the nvcc builds cost
#             time). ~6-7 min cold with the check and 4 configs.
#             Where host IO is a real share of the step (the kit model's
#             step is scheduler Python): GF_INDEXSHARE_LAYERS=N serves
#             scripts/model_config.py --geometry v32 with N layers
#             (GF_INDEX_PATTERN=glm52: GLM-5.2's 21 anchors per 78 layers;
#             workload decode16k, 16 hot buffers decoding at once),
#             GF_INDEXSHARE_SYNTHETIC=calibrated the calibrated top-k
#             (default: the random weights' own). The IndexShare line then
#             has an indexshare-decode row (decode-only rate, server step).
#             Config warp is ours with one-warp replay blocks
#             (SGLANG_HISPARSE_PREFETCH_GRID=smx32; the line gets a
#             WORKLOAD/warp row); SGLANG_HISPARSE_PREFETCH_GRID set on the
#             command reaches every config. Pin the cores
#             (GF_CPUS=fastest:4), or the cores' spread (2x) decides.
#             Config prio16: ours with the prefetch stream above the
#             forward's priority and 16 x 512 replays. GF_INDEXSHARE_TOGETHER=1
#             (timing runs): every config's server starts at once and the
#             workloads run one server at a time, configs taking turns over
#             GF_INDEXSHARE_INNER rounds, order reversed every other round
#             (e2e_gpu.py --together; the idle servers sit on the cores
#             GF_CPUS leaves): one start-up's time for all configs.
#             GF_MEM_FRACTION (0.45): each indexshare server's
#             --mem-fraction-static; on an 80 GB card three --together
#             servers of 16+ V3.2 layers need 0.85 (the workload's
#             --max-total-tokens still caps each pool).
#   dsv4      DeepSeek-V4 (issue #19; smoke, concurrent served 2026-12-04-s2): the tiny
#             random-weight model tests/data/tiny-dsv4 (4 layers, compress
#             ratios 0/4/128/4, index_topk 512, one NextN layer) served by
#             e2e_gpu.py, which gives a V4 model its own flags (SGLang forces
#             attention backend dsv4, page 256, fp8_e4m3 KV; no DSA backend
#             flags) and SGLANG_OPT_FP8_WO_A_GEMM=0 (exported here too).
#             tilelang + libz3 come from .bundle/dsv4.tar.xz via
#             scripts/dsv4_env.sh (unpacked once into /tmp/dsv4). Configs
#             GF_DSV4_CONFIGS (base,ours: ours = our HiSparse C4 pools with
#             --check), workloads GF_DSV4_WORKLOADS (smoke; also concurrent:
#             16 x 9000, capacity: 16 x 16000 x 128 out at
#             --max-total-tokens 40000, and drain: aborts and forced
#             retraction, then a probe whose decode lines must show the
#             pools back, each in a command of its own),
#             --hisparse-config GF_DSV4_HS ({"top_k": 512,
#             "device_buffer_size": 1024, "host_to_device_ratio": 2}: top-k and
#             hot buffer in C4 rows, 4 tokens each, so 1024 rows hold 4096
#             tokens and every workload's long prompts read from host), model
#             GF_DSV4_MODEL, --warmup 0. Prints per launch "ready in", per
#             workload "N ok, M errors" with the host misses and the check's
#             counters, then the workload table (requests ok/err, logprobs vs
#             base: confident steps, violations over 0.05, max |dlogprob|) and
#             the check table (checked, mismatches, #hisparse miss, verdict).
#             Estimate (nothing measured): launch ~60-100 s each, the first
#             request of a cold machine ~2.5 min of JIT (tvm-ffi, deep_gemm,
#             flashinfer) plus tilelang's mHC kernels (nvcc, ~0.5 min each
#             on this CPU machine for the smallest), smoke ~0.5 min a config,
#             concurrent ~1 min, capacity ~1.5-2 min (prefills nearly serial
#             for ours: its C4 device pool is 40000 / (4 x 2) = 4992 rows,
#             and a 16000-token prompt takes 4000 while it prefills). So:
#             smoke on base,ours ~6-7 min cold (with jit); concurrent ~5 min
#             and capacity ~6 min warm, each in its own command (smoke and
#             concurrent share a launch, but together they pass the ~450 s
#             a cold command with jit leaves the stage). Cap GF_DSV4_CAP_S
#             (540 s).
#             The kit (45 MB) + .bundle/dsv4.tar.xz (~26 MB) + the tree are
#             over one call's 64 MiB: two calls on one warm machine, the
#             second within ~30 s of the first:
#               1. carry [".bundle/dsv4.tar.xz"]: bash scripts/dsv4_env.sh
#               2. carry [".bundle/site.tar.xz.00", ".gpu"]:
#                  bash scripts/gpu_stages.sh dsv4 jit
#               3. (warm) carry [".gpu"]: GF_DSV4_WORKLOADS=concurrent
#                  bash scripts/gpu_stages.sh dsv4; 4. the same with capacity
#             (a machine given back in between: the stage stops at once
#             saying so; start again at 1).
#   pin       another supported pin side by side with the kit's (issue #21):
#             e2e_gpu.py with configs GF_PIN_CONFIGS (base,native,ours) on
#             GF_PIN_WORKLOADS (smoke,concurrent,capacity), GF_PIN_REPEATS (1)
#             rounds of GF_PIN_INNER (3) runs per launch, no check (the
#             `check` stage is the exactness half): the ratios vs base and
#             native of whichever SGLang the command runs (GF_SGLANG below).
#             GF_PIN_BASELINE=JSON: base's runs from an earlier pin.json
#             instead of launching base (outputs compared; ratios then span
#             two launches' machines). GF_PIN_SGLANG=0.5.13,0.5.17: the same
#             configurations once per pin in this one command (pin-V.json),
#             for ratios measured side by side: carry [".bundle/site.tar.xz.00",
#             ".bundle/jitcache.tar.xz", ".gpu"] on a machine where an earlier
#             GF_SGLANG=0.5.17 command left /tmp/site-0.5.17 (and its JIT
#             cache). Three configs on one workload group (smoke,concurrent
#             or capacity) take ~270 s warm for one pin, so one command per
#             pin and group fits; both pins in one command fit two configs
#             on smoke (~330 s).
#   jit       save_jit_cache: the kernel caches as jitcache.tar.xz (split in
#             15 MiB parts when larger; not returned above ~45 MiB). Run
#             last; ~0.5-1 min. Then, here:
#             cat jitcache.tar.xz* > .bundle/jitcache.tar.xz
#   jitfit    the same, only if 60 s of the budget are left once the other
#             stages end: nothing is kept back for it, so a cold command
#             sized for its stages can ask for it (jit keeps 60 s back from
#             every stage: 2026-12-06-s5's cold decodelong stage took 469 s
#             of 491 and would have been cut off at 431).
# A split that fits 3 commands of <= 10 min (plus ~1 min machine start each):
#   1. bash scripts/gpu_stages.sh bg-tests check fault jit   (~6-7 min)
#   2. bash scripts/gpu_stages.sh e2e1 deep                  (~8-10 min cold)
#   3. bash scripts/gpu_stages.sh e2e2                       (~5-7 min)
# Another pin: GF_SGLANG=0.5.17 runs every stage on sglang 0.5.17 instead of
# the kit's 0.5.13, from .bundle-0.5.17/ (scripts/pack_pin.sh 0.5.17, here),
# unpacked once per machine into /tmp/site-0.5.17. Its parts (site.tar.xz.NN,
# 61 MB, split at 32 MiB) do not fit one call, so they gather in
# /tmp/bundle-0.5.17 on the warm machine, the second call within ~30 s:
#   1. carry [".bundle-0.5.17/site.tar.xz.00"]:
#      mkdir -p /tmp/bundle-0.5.17 && cp .bundle-0.5.17/site.tar.xz.00 /tmp/bundle-0.5.17/
#   2. carry [".bundle-0.5.17/site.tar.xz.01", ".bundle-0.5.17/PARTS", ".gpu",
#      ".bundle/wheels"]: GF_SGLANG=0.5.17 bash scripts/gpu_stages.sh STAGE...
# Later commands on that machine need only [".gpu"] (and ".bundle/wheels"
# for the tests). The JIT caches of both pins share $HOME.
# Environment: GF_BUDGET_S (570), GF_TESTS (test ids for tests/bg-tests
# instead of the GPU files), GF_E2E_BASE (1; 0: e2e rounds without
# base), GF_CPUS (e.g. fastest:4: pin e2e servers
# to the cores timed fastest; only with a warm JIT cache, kernel builds get
# those cores only), GF_CHECK_CONFIGS (ours), GF_DEEP_LAYERS (61),
# GF_DEEP_CONFIGS (ours), GF_XDIST_WORKERS (8), GF_PARALLEL (0; 1: mtp,
# dsv4 and indexshare with its check launch their configurations at once,
# e2e_gpu.py --parallel, on a machine whose kernel caches are warm).
#
# Results come back as at most 8 files under $OUT: summary.txt (each
# stage's rc, wall time and result lines), gf_logs.tar.xz (every stage's
# output, JSON and server log; tar -xJf), jitcache.tar.xz[.NN].
set -u
STAGES=("$@")
if [ ${#STAGES[@]} -eq 0 ]; then
  sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
for s in "${STAGES[@]}"; do
  case $s in tests|bg-tests|check|fault|e2e|e2e1|e2e2|deep|trace|decode|bound|stream|kbench|mtp|mtpproof|mtpperf|mtpprof|pd|indexshare|dsv4|pin|jit|jitfit) ;;
    *) echo "unknown stage $s (tests bg-tests check fault e2e e2e1 e2e2 deep trace decode bound stream kbench mtp mtpproof mtpperf mtpprof pd indexshare dsv4 pin jit jitfit)"; exit 2 ;;
  esac
done
[ -f scripts/e2e_gpu.py ] && [ -f .gpu/device_env.sh ] || {
  echo "run from the repo root with .gpu and .bundle carried"; exit 2; }

T0=$(date +%s)
BUDGET_S=${GF_BUDGET_S:-570}
REPO=$(pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${TMPDIR:-/tmp}/gpu_stages
RUN=$WORK/run_$(date +%Y%m%d_%H%M%S)_$$
mkdir -p "$RUN"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(( $(date +%s) - T0 )); }

WANT_JIT=0 JIT_IF_TIME=0
for s in "${STAGES[@]}"; do
  [ "$s" = jit ] && WANT_JIT=1
  [ "$s" = jitfit ] && JIT_IF_TIME=1
done
# Kept back from every stage: packing the logs (and saving the JIT cache).
RESERVE=$(( 15 + 60 * WANT_JIT ))

jitfit_left() {  # what jitfit's save has once the stages end (15 s: packing the logs)
  echo $(( BUDGET_S - $(elapsed) - 15 ))
}

finish() {
  local rc=$?
  declare -F say_doctor >/dev/null && say_doctor
  [ -n "${BG_PID:-}" ] && wait_bg
  if [ "$WANT_JIT" = 0 ] && [ "$JIT_IF_TIME" = 1 ]; then
    local jit_left; jit_left=$(jitfit_left)
    if [ "$jit_left" -ge 60 ]; then WANT_JIT=1; else say "== jitfit: SKIPPED ($jit_left s left, needs ~60 s)"; fi
  fi
  if [ "$WANT_JIT" = 1 ]; then
    local s; s=$(date +%s)
    if declare -F save_jit_cache >/dev/null && save_jit_cache "$RUN"; then
      local size; size=$(stat -c %s "$RUN/jitcache.tar.xz")
      if [ "$size" -le $(( 15 * 1024 * 1024 )) ]; then
        cp "$RUN/jitcache.tar.xz" "$OUT/"
        say "== jit: jitcache.tar.xz $(( size / 1024 )) KiB in $(( $(date +%s) - s )) s"
      elif [ "$size" -le $(( 45 * 1024 * 1024 )) ]; then
        split -b 15M -d -a 2 "$RUN/jitcache.tar.xz" "$OUT/jitcache.tar.xz."
        say "== jit: jitcache.tar.xz $(( size / 1024 / 1024 )) MiB in parts $(cd "$OUT" && echo jitcache.tar.xz.*)" \
            "($(( $(date +%s) - s )) s); here: cat jitcache.tar.xz.* > .bundle/jitcache.tar.xz"
      else
        say "== jit: jitcache.tar.xz is $(( size / 1024 / 1024 )) MiB, over what comes back; not returned"
      fi
      rm -f "$RUN/jitcache.tar.xz"
    else
      say "== jit: save_jit_cache failed"
    fi
  fi
  say "== total $(elapsed) s (budget $BUDGET_S s)"
  # xz on every core in 4 MiB blocks: an e2e run's JSON holds every token
  # (53 MB for 11 decodebound runs, 2026-12-07-s10) and one xz thread took
  # ~55 s of device time after "total" to pack it (here, two cores: 48.7 s
  # single, 17.5 s in blocks; 6.4 against 6.8 MB).
  export XZ_OPT="-T0 --block-size=4MiB"
  tar -C "$RUN" --exclude=./proj -cJf "$OUT/gf_logs.tar.xz" . 2>/dev/null
  if [ "$(stat -c %s "$OUT/gf_logs.tar.xz" 2>/dev/null || echo 0)" -gt $(( 15 * 1024 * 1024 )) ]; then
    # Too large to come back: keep stage outputs, JSON and the ends of the server logs.
    find "$RUN" -name '*.log' -size +2M -exec sh -c 'tail -c 2000000 "$1" > "$1.tail" && rm "$1"' _ {} \;
    tar -C "$RUN" --exclude=./proj -cJf "$OUT/gf_logs.tar.xz" .
  fi
  exit $rc
}
trap finish EXIT
trap 'exit 143' TERM INT

say "== gpu_stages: stages ${STAGES[*]}; run dir $RUN"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/   gpu: /' | tee -a "$SUMMARY"

# --- environment: the kit, this work tree's package, the ref package ---------
KIT_SGLANG=0.5.13  # the kit's bundle (.bundle/site.tar.xz.*, unpacked into /tmp/site)
# use_site SITE: the Python and library paths name SITE (a pin's unpacked
# bundle: /tmp/site or /tmp/site-V) instead of whichever pin's site they
# named; both paths, so a pin never runs on another pin's libraries.
use_site() {
  PYTHONPATH=$(echo "$PYTHONPATH" | sed -E "s#(^|:)/tmp/site(-[^:/]*)?(:|\$)#\1$1\3#")
  LD_LIBRARY_PATH=$(echo "${LD_LIBRARY_PATH:-}" | sed -E "s#(^|:)/tmp/site(-[^:/]*)?/_libs#\1$1/_libs#")
  export PYTHONPATH LD_LIBRARY_PATH
}
if [ -n "${GF_SGLANG:-}" ]; then
  # device_env.sh unpacks the kit's bundle when it was carried; its site is
  # then swapped for this pin's below, whichever was unpacked.
  PIN_SITE=/tmp/site-$GF_SGLANG
  if [ ! -f "$PIN_SITE/.ok" ]; then
    PARTS_DIR=/tmp/bundle-$GF_SGLANG  # parts carried by earlier calls gather here
    mkdir -p "$PARTS_DIR"
    cp .bundle-"$GF_SGLANG"/site.tar.xz.* .bundle-"$GF_SGLANG"/PARTS "$PARTS_DIR"/ 2>/dev/null
    have=$(ls "$PARTS_DIR"/site.tar.xz.* 2>/dev/null | wc -l)
    want=$(cat "$PARTS_DIR/PARTS" 2>/dev/null || echo "?")
    if [ "$have" != "$want" ]; then
      say "== GF_SGLANG=$GF_SGLANG: $have of $want bundle parts on this machine ($PARTS_DIR); carry the rest"
      exit 1
    fi
    mkdir -p "$PIN_SITE"
    cat "$PARTS_DIR"/site.tar.xz.* | xz -dc -T0 | tar -C "$PIN_SITE" -xf - && touch "$PIN_SITE/.ok"
  fi
fi
source .gpu/device_env.sh
if [ -n "${GF_SGLANG:-}" ]; then
  # This pin's kernel caches, brought back by an earlier command's `jit` stage.
  if [ -f .bundle-"$GF_SGLANG"/jitcache.tar.xz ] && [ ! -f "$PIN_SITE/.jit" ]; then
    tar -C "$HOME" -xJf .bundle-"$GF_SGLANG"/jitcache.tar.xz && touch "$PIN_SITE/.jit"
  fi
  use_site "$PIN_SITE"
fi
# sglang_where: "VERSION from PATH" of the sglang the servers will import
# (the first on the Python path), read as the doctor reads it
# (sglang_hisparse.pinned_source: the dist-info beside the package), so
# this package must be on the Python path. Not by importing sglang: every
# command spent ~13 s before its first stage (2026-12-07-s11: "install ...
# (13 s)"), and the import is likely most of it (not timed there; here, on
# two cores, 12.9 s against 0.07 s).
sglang_where() {
  python3 - <<'PY'
from sglang_hisparse.pinned_source import TargetNotFound, installed_sglang_root, sglang_version
try:
    root = installed_sglang_root()
except TargetNotFound:
    print("not importable")
else:
    try:
        version = sglang_version(root)
    except TargetNotFound:
        version = "(no dist-info)"
    print(version, "from", root / "sglang")
PY
}
if declare -F save_jit_cache >/dev/null; then
  # The kit's list plus ~/.tilelang (DeepSeek-V4's mHC kernels, dsv4 stage).
  save_jit_cache() {
    tar -C "$HOME" -cf - $(cd "$HOME" && ls -d .cache/tvm-ffi .cache/flashinfer .cache/deep_gemm \
      .cache/sglang .triton .deep_gemm .tilelang 2>/dev/null) 2>/dev/null | xz -T0 -3 > "$1/jitcache.tar.xz"
  }
fi
# Each run installs into its own directory: a second run started beside
# this one would otherwise delete the package its servers import. No build
# (pip's took 23-28 s of every command): scripts/install_tree.py lays out
# what a wheel would, the package and a dist-info with its entry points.
PROJ=$RUN/proj
if ! python3 scripts/install_tree.py "$PROJ" > "$RUN/install.log" 2>&1; then
  say "== install: FAILED (see install.log)"; tail -20 "$RUN/install.log"; exit 1
fi
export PYTHONPATH="$PROJ${PYTHONPATH:+:$PYTHONPATH}"
say "== install: $(ls -d "$PROJ"/sglang_hisparse-*.dist-info | xargs -n1 basename) into $PROJ ($(elapsed) s)"
say "   sglang $(sglang_where 2>&1 | tail -1)"
# Which pin the plugin sees and whether it would install: doctor's verdict.
# It runs beside the first stage (36 s of imports on the H100 of
# 2026-12-06-s6, more than the stages' start-up margin of a short command:
# a 290 s command skipped its only stage) and says its line when the first
# stage ends (say_doctor, in the stage loop: the main shell is its parent),
# or at the end.
python3 -m sglang_hisparse doctor > "$RUN/doctor.out" 2>&1 &
DOCTOR_PID=$!
# The machine's host link (bench_kernels.py --host-link: pinned H2D rate,
# the GPU's NUMA node), said with doctor's line. On 2026-12-07-s7 ours' step
# with host misses ran 13% slower than on the H100 of -s5 while base and
# native did not, and no run had recorded the link. It copies 4 GiB of
# pinned memory (~0.1 s at 55 GB/s) while the stage's servers load.
python3 scripts/bench_kernels.py --host-link > "$RUN/host_link.out" 2>&1 &
HOST_LINK_PID=$!
say_doctor() {
  [ -n "${DOCTOR_PID:-}" ] || return 0
  wait "$DOCTOR_PID"; local rc=$?
  DOCTOR_PID=""
  if [ -n "${HOST_LINK_PID:-}" ]; then
    wait "$HOST_LINK_PID"; HOST_LINK_PID=""
    say "   $(grep -E '^host link' "$RUN/host_link.out" || tail -1 "$RUN/host_link.out")"
  fi
  say "   doctor (rc $rc): $(grep -E '^(sglang |supported|installed)' "$RUN/doctor.out" | paste -sd';' -);" \
      "entries OK $(grep -cE '^  OK ' "$RUN/doctor.out"), FAIL $(grep -cE '^  FAIL ' "$RUN/doctor.out")"
}

REF=$REPO/.bundle/ref_pkg
REF_CONFIGS=""
if [ -f "$REF/sglang_hisparse/__init__.py" ] && ls "$REF"/sglang_hisparse-*.dist-info >/dev/null 2>&1; then
  REF_CONFIGS=ref
  say "   ref package: $REF ($(cat "$REF/REF_COMMIT" 2>/dev/null || echo 'no REF_COMMIT'))"
else
  say "   no .bundle/ref_pkg: the e2e stages run without configuration ref"
fi

# A port no earlier server still holds (one left running would answer the
# health checks of the next launch).
PORT=$(python3 - <<'EOF'
import socket
for port in range(30010, 30100, 7):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
    break
EOF
)
[ "$PORT" = 30010 ] || say "   port 30010 is taken (a server left over?); using $PORT"

# --- stage runner ---------------------------------------------------------------
# run_stage NAME NEED_S CAP_S CMD...: runs CMD under timeout min(CAP_S, time
# left), output in $RUN/NAME.out, a summary in $RUN/NAME.summary.
run_stage() {
  local name=$1 need=$2 cap=$3; shift 3
  local left=$(( BUDGET_S - $(elapsed) - RESERVE - 45 ))  # 45: SIGTERM grace + stop
  if [ "$left" -lt "$need" ]; then
    # Say the budget that would have run it: GF_BUDGET_S also pays for the
    # set-up before the stage (~15 s), the reserve and the stop grace, so a
    # stage that needs 200 s wants ~275 s; on 2026-12-07-s8 three stages
    # set at 200-265 were skipped, 36-39 s of device time each for nothing.
    echo "== $name: SKIPPED ($left s left, needs ~$need s: GF_BUDGET_S=$(( BUDGET_S + need - left )) would run it)" \
      > "$RUN/$name.summary"
    return 0
  fi
  local t=$(( cap < left ? cap : left ))
  local s; s=$(date +%s)
  timeout -k 40 "$t" "$@" > "$RUN/$name.out" 2>&1
  local rc=$?
  # A cut-off stage's servers (their own sessions: timeout's signals miss
  # them) must not outlive it: 2026-12-06-s4's held 58 GB of the GPU and
  # the next command's servers were killed at start-up. Stages run one
  # at a time, so whatever server is left now is the cut-off stage's.
  local left_over=""
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    pkill -9 -f '[s]glang.launch_server|[s]glang::' && left_over=" (killed the servers it left running)"
  fi
  {
    echo "== $name: rc=$rc$([ $rc -eq 124 ] && echo ' (TIMED OUT)') in $(( $(date +%s) - s )) s (limit $t s)$left_over"
    summarize_stage "$name"
  } > "$RUN/$name.summary"
  return 0
}

summarize_stage() {
  local f=$RUN/$1.out
  case $1 in
    tests|bg-tests|indexshare-tests)
      grep -E '^(FAILED|ERROR) ' "$f" | head -30
      grep -E '^=+ .*[0-9]+ (passed|failed|errors?|skipped)' "$f" | tail -1
      grep -q -E '^=+ .*[0-9]+ (passed|failed|errors?|skipped)' "$f" || tail -5 "$f" ;;
    kbench)
      grep -E '^( *bs|ndt| *miss| *[0-9]+%? |worst|pinned|device|overlap)' "$f" | cut -c1-200
      grep -q -E '^(ndt| *miss)' "$f" || tail -15 "$f" ;;
    dsv4)
      grep -E '^dsv4_env|^model |\] (sglang_hisparse from|ready in|FAILED)|^\[[a-z]+ rep[0-9.]+\] [a-z]+: |Traceback|counter flush' "$f" | cut -c1-400
      sed -n '/^workload    config/,$p' "$f"
      grep -q '^workload    config' "$f" || tail -20 "$f" ;;
    pd)
      grep -E '^\[[a-z0-9-]+\] (ready|FAILED)|^mooncake_env|Traceback' "$f" | cut -c1-300
      sed -n '/^PD summary/,$p' "$f"
      grep -q '^PD summary' "$f" || tail -20 "$f" ;;
    mtpproof)
      grep -v '^$' "$f" | cut -c1-400 ;;
    decode|mtpprof)
      grep -E '^\[[a-z]+\] ' "$f" | cut -c1-300
      sed -n '/^per decode step/,$p' "$f"
      grep -q '^per decode step' "$f" || tail -15 "$f" ;;
    *)
      grep -E '\] (sglang_hisparse from|FAILED)|^--ref-pkg|^cpu probe|^servers run on|Traceback|counter flush' "$f" | cut -c1-300
      # e2e_gpu's own tables: the workload table, the limit lines, the check table.
      sed -n '/^workload    config/,$p' "$f"
      grep -q '^workload    config' "$f" || tail -15 "$f" ;;
  esac
}

show() { cat "$RUN/$1.summary" | tee -a "$SUMMARY"; }

BG_PID=""
wait_bg() {
  [ -n "$BG_PID" ] || return 0
  say "   (waiting for the background tests)"
  wait "$BG_PID"
  BG_PID=""
  show bg-tests
}

E2E=(python3 scripts/e2e_gpu.py --port "$PORT")
# GF_PARALLEL=1: the stages that time nothing (mtp, dsv4, indexshare with
# its check) launch their configurations at once (e2e_gpu.py --parallel;
# 2026-12-04-s3: 16 MTP servers ready and served in 140 s), instead of one
# after the other. Needs warm kernel caches, as mtpproof does.
PAR=()
[ "${GF_PARALLEL:-0}" = 1 ] && PAR=(--parallel)
CPU_ARGS=(--cpu-probe)
[ -n "${GF_CPUS:-}" ] && CPU_ARGS=(--cpus "$GF_CPUS")
HS_RATIO2='{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2}'
# DeepSeek-V4's top-k and hot buffer count C4 rows (4 tokens each).
HS_DSV4='{"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 2}'
join() { local IFS=,; echo "$*"; }
# GF_E2E_BASE=0 leaves base out of the e2e rounds (before/after needs only
# ref and ours); ROUND_N: launches per round, for the stage's time estimate.
BASE_CONFIG=base
[ "${GF_E2E_BASE:-1}" = 0 ] && BASE_CONFIG=""
ROUND_N=$(( 1 + $([ -n "$BASE_CONFIG" ] && echo 1 || echo 0) + $([ -n "$REF_CONFIGS" ] && echo 1 || echo 0) ))

test_files() {
  # GF_TESTS: these test ids instead (e.g. a rerun of the failures).
  [ -n "${GF_TESTS:-}" ] && { echo "$GF_TESTS"; return; }
  local f files=()
  for f in tests/test_kernel_gpu.py tests/test_host_memory_gpu.py tests/test_host_pool_gpu.py \
           tests/test_exactness_kernel_gpu.py \
           tests/test_streams_gpu.py; do
    [ -f "$f" ] && files+=("$f")
  done
  grep -q 'def test_soak_on_gpu' tests/test_soak.py 2>/dev/null && files+=(tests/test_soak.py::test_soak_on_gpu)
  echo "${files[@]}"
}

tests_cmd() {
  local xd=$WORK/xd
  if [ ! -f "$xd/.ok" ]; then
    python3 -m pip install -q --no-deps --no-index --target "$xd" .bundle/wheels/*.whl && touch "$xd/.ok" \
      || { echo "cannot install .bundle/wheels (pytest-xdist, execnet)"; return 1; }
  fi
  # shellcheck disable=SC2046
  env PYTHONPATH="$xd${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -n "${GF_XDIST_WORKERS:-8}" -p xdist \
    -p no:benchmark -p no:cacheprovider -v -rfEs --junitxml="$RUN/tests.xml" $(test_files)
}

e2e_round() {  # e2e_round NAME CONFIGS REPEATS
  "${E2E[@]}" --configs "$2" --workloads capacity,lone --repeats "$3" "${CPU_ARGS[@]}" \
    ${REF_CONFIGS:+--ref-pkg "$REF"} --out "$RUN/$1.json" --logs "$RUN/$1"
}

deep_cmd() {
  local model=$WORK/dsv32-${GF_DEEP_LAYERS:-61}
  python3 scripts/model_config.py --geometry v32 --layers "${GF_DEEP_LAYERS:-61}" --out "$model" || return 1
  "${E2E[@]}" --model "$model" --configs "${GF_DEEP_CONFIGS:-ours}" --workloads deep --check \
    --warmup 0 --hisparse-config "$HS_RATIO2" --server-args "--mem-fraction-static 0.45" \
    --out "$RUN/deep.json" --logs "$RUN/deep"
}

trace_cmd() {
  # -m gpu: the CPU tests' Triton interpreter fails on the device image's numpy.
  python3 -m pytest -p no:cacheprovider -q -rfEs -m gpu tests/test_synthetic_top_k.py
  python3 scripts/bench_kernels.py --trace calibrated
}

v32_model() {  # v32_model LAYERS: writes the model dir, prints its path
  local model=$WORK/dsv32-$1
  python3 scripts/model_config.py --geometry v32 --layers "$1" --out "$model" >/dev/null && echo "$model"
}

decode_cmd() {
  local model; model=$(v32_model "${GF_DECODE_LAYERS:-61}") || return 1
  local syn=${GF_DECODE_SYNTHETIC-calibrated}
  python3 scripts/profile_decode.py --model "$model" --port "$PORT" \
    --configs "${GF_DECODE_CONFIGS:-base:2,ours:16}" ${syn:+--synthetic "$syn"} \
    --prompt 32000 --new "${GF_DECODE_NEW:-400}" --steps 8 --warm-s 2 --no-stack \
    ${GF_DECODE_END:+--end-after-profile "$GF_DECODE_END"} ${GF_DECODE_PLATEAU:+--plateau-s "$GF_DECODE_PLATEAU"} \
    ${GF_DECODE_JOIN:+--join-timeout-s "$GF_DECODE_JOIN"} \
    --extra "--max-total-tokens ${GF_DECODE_TOKENS:-72000} --context-length 40960 --mem-fraction-static ${GF_DECODE_MEM:-0.45} --cuda-graph-max-bs 16" \
    --out "$RUN/decode"
}

mtp_cmd() {  # ours vs base with the check and the parity, then the drain (see the header)
  local rc=0
  "${E2E[@]}" "${PAR[@]}" --configs "${GF_MTP_CONFIGS:-base,ours}" --workloads "${GF_MTP_WORKLOADS:-smoke}" \
    --mtp "${GF_MTP:-1,1,2}" ${GF_MTP_HS:+--hisparse-config "$GF_MTP_HS"} --check --warmup 0 \
    --out "$RUN/mtp.json" --logs "$RUN/mtp" || rc=1
  if [ -n "${GF_MTP_DRAIN_CONFIGS-nograph}" ]; then
    "${E2E[@]}" "${PAR[@]}" --configs "${GF_MTP_DRAIN_CONFIGS-nograph}" --workloads drain \
      --mtp "${GF_MTP:-1,1,2}" ${GF_MTP_HS:+--hisparse-config "$GF_MTP_HS"} --check --warmup 0 \
      --out "$RUN/mtp_drain.json" --logs "$RUN/mtp_drain" || rc=1
  fi
  return $rc
}

# mtpproof's calls: NAME|environment|--mtp|hot buffer|configs|workload
MTPPROOF_CALLS=(
  "a112||1,1,2|4096|base,base2,plain,ours,nores,nograph|smoke"
  "d112||1,1,2|4096|ours,nopark,nograph|drain"
  "a314||3,1,4|8192|base,ours,nores|smoke"
  "s2|SGLANG_SIMULATE_ACC_LEN=2|3,1,4|8192|base,nores|smoke"
  "s3|SGLANG_SIMULATE_ACC_LEN=3|3,1,4|8192|base,base2,ours,nores|smoke"
  "d314||3,1,4|8192|ours|drain"
)

wait_calls() {
  # Several e2e_gpu.py calls of one stage, each given as PID|OUTPUT|TITLE
  # (PID done:RC for a call that already ran; the title last, as it may
  # hold |): wait for each, then print its exit status, its launch lines and
  # its tables; 1 if any call failed.
  local call pid title out r rc=0
  for call in "$@"; do
    IFS='|' read -r pid out title <<< "$call"
    if [[ $pid == done:* ]]; then r=${pid#done:}; else wait "$pid"; r=$?; fi
    [ "$r" = 0 ] || rc=1
    echo "== $title: rc $r"
    grep -E '\] (ready in|FAILED)|^servers run on|Traceback' "$out" | cut -c1-300
    sed -n '/^workload    config/,$p' "$out"
  done
  return $rc
}

mtpproof_cmd() {  # the calls at once, each on ports of its own (see the header)
  local spec name envs mtp hot configs w i=0 calls=() extra
  local want=",${GF_MTPPROOF:-a112,d112,a314,s2,s3,d314},"
  for spec in "${MTPPROOF_CALLS[@]}"; do
    IFS='|' read -r name envs mtp hot configs w <<< "$spec"
    [[ $want == *",$name,"* ]] || continue
    extra=()
    # The smoke's longest pair is 15.5K tokens; 40000 rows keep each pool
    # small (the drain brings its own 30000).
    [ "$w" = smoke ] && extra=(--server-args "--max-total-tokens 40000")
    env $envs "${E2E[@]}" --port $(( PORT + 100 * i )) --parallel --mtp "$mtp" \
      --hisparse-config "{\"top_k\": 2048, \"device_buffer_size\": $hot, \"host_to_device_ratio\": 2}" \
      --configs "$configs" --workloads "$w" --check --warmup 0 "${extra[@]}" \
      --out "$RUN/mtpproof_$name.json" --logs "$RUN/mtpproof_$name" > "$RUN/mtpproof_$name.out" 2>&1 &
    calls+=("$!|$RUN/mtpproof_$name.out|mtpproof $spec"); i=$(( i + 1 ))
  done
  wait_calls "${calls[@]}"
}

mtpperf_cmd() {
  "${E2E[@]}" --configs "${GF_MTP_PERF_CONFIGS:-base,ours}" \
    --workloads "${GF_MTP_PERF_WORKLOADS:-capacity,lone}" ${GF_MTP_PERF_EXTRA:-} \
    --mtp "${GF_MTP:-1,1,2}" ${GF_MTP_HS:+--hisparse-config "$GF_MTP_HS"} \
    --repeats "${GF_MTP_PERF_REPEATS:-1}" "${CPU_ARGS[@]}" \
    --out "$RUN/mtpperf.json" --logs "$RUN/mtpperf"
}

mtpprof_cmd() {
  python3 scripts/profile_decode.py --mtp "${GF_MTP:-1,1,2}" --port "$PORT" \
    --configs "${GF_MTPPROF_CONFIGS:-base,ours}" --prompt 16000 --new 1500 --steps 12 --warm-s 1 \
    --no-stack --extra "--max-total-tokens 40000" --out "$RUN/mtpprof"
}

indexshare_need_s() {
  # What the stage needs before it starts: a launch and its workload per
  # config and round, ~100 s on the V3.2 geometry (2026-12-03-s5: 295 s for
  # three warm) and ~60 s on the kit model; a stage started with less only
  # times out after its first configs. Launched at once (GF_PARALLEL=1 with
  # the check), every pattern and config takes about two launches' time.
  local configs=${GF_INDEXSHARE_CONFIGS:-base,ours,sync,noio} per=60
  [[ -n "${GF_INDEXSHARE_LAYERS:-}" || ${GF_INDEX_PATTERN:-} == *@* ]] && per=100
  local n; n=$(tr ',' '\n' <<< "$configs" | grep -c .)
  [[ ${GF_PARALLEL:-0} = 1 && ${GF_INDEXSHARE_CHECK:-1} != 0 ]] && n=2
  if [[ ${GF_INDEXSHARE_TOGETHER:-0} = 1 && ${GF_INDEXSHARE_CHECK:-1} = 0 ]]; then
    # one start-up for all, then about half a launch per config and round
    echo $(( (30 + per + per / 2 * n * ${GF_INDEXSHARE_INNER:-1}) * ${GF_INDEXSHARE_REPEATS:-1} ))
    return
  fi
  echo $(( 30 + per * n * ${GF_INDEXSHARE_REPEATS:-1} ))
}

indexshare_one() {  # $1: PATTERN or PATTERN@LAYERS, $2: port, $3: name of its outputs
  local check=(--check --warmup 0 "${PAR[@]}")
  [ "${GF_INDEXSHARE_CHECK:-1}" = 0 ] && check=()  # timing: one launch after the other
  # GF_INDEXSHARE_TOGETHER=1 (timing): every config's server starts at once,
  # the workloads then run one server at a time, configs taking turns
  # GF_INDEXSHARE_INNER rounds (e2e_gpu.py --together): one start-up for all.
  local together=()
  [ "${GF_INDEXSHARE_TOGETHER:-0}" = 1 ] && [ ${#check[@]} = 0 ] && together=(--together)
  # PATTERN@LAYERS (or GF_INDEXSHARE_LAYERS=N): the V3.2 geometry with that
  # many layers instead of the kit model, sized as the 32K workloads are (16
  # hot buffers at 72000 rows); launched at once, --parallel's fraction.
  local pattern=${1%@*} layers=${GF_INDEXSHARE_LAYERS:-}
  [[ $1 == *@* ]] && layers=${1#*@}
  # GF_MEM_FRACTION: each server's --mem-fraction-static (0.45). Three
  # --together servers of 20 layers (22 GB of weights each) do not fit an
  # H100's 80 GB at 0.45 (2026-12-05-s3: two exited "Not enough memory").
  local model=() syn=${GF_INDEXSHARE_SYNTHETIC:-} fraction="--mem-fraction-static ${GF_MEM_FRACTION:-0.45} "
  [ ${#PAR[@]} -gt 0 ] && [ ${#check[@]} -gt 0 ] && fraction=""
  [ -n "$layers" ] && model=(--geometry v32 --layers "$layers"
    --server-args "${fraction}--cuda-graph-max-bs 16")
  "${E2E[@]}" --port "$2" --configs "${GF_INDEXSHARE_CONFIGS:-base,ours,sync,noio}" \
    --workloads "${GF_INDEXSHARE_WORKLOADS:-capacity}" --index-pattern "$pattern" \
    --repeats "${GF_INDEXSHARE_REPEATS:-1}" --inner-repeats "${GF_INDEXSHARE_INNER:-1}" \
    "${check[@]}" "${together[@]}" "${CPU_ARGS[@]}" "${model[@]}" \
    ${syn:+--synthetic "$syn"} --out "$RUN/$3.json" --logs "$RUN/$3"
}

indexshare_cmd() {
  # GF_INDEX_PATTERN: one pattern, or several (FSSS,FSFS,glm52@12), each an
  # e2e_gpu.py call on ports of its own; at once under GF_PARALLEL=1 with the
  # check, else one after the other. One pattern keeps the old output names.
  local entries i name calls=()
  IFS=, read -r -a entries <<< "${GF_INDEX_PATTERN:-FSSS}"
  if [ ${#entries[@]} = 1 ]; then
    indexshare_one "${entries[0]}" "$PORT" indexshare
    return
  fi
  for i in "${!entries[@]}"; do
    name="indexshare_${entries[$i]/@/_}"
    if [ ${#PAR[@]} -gt 0 ] && [ "${GF_INDEXSHARE_CHECK:-1}" != 0 ]; then
      indexshare_one "${entries[$i]}" $(( PORT + 100 * i )) "$name" > "$RUN/$name.out" 2>&1 &
      calls+=("$!|$RUN/$name.out|indexshare ${entries[$i]}")
    else
      indexshare_one "${entries[$i]}" $(( PORT + 100 * i )) "$name" > "$RUN/$name.out" 2>&1
      calls+=("done:$?|$RUN/$name.out|indexshare ${entries[$i]}")
    fi
  done
  wait_calls "${calls[@]}"
}

pin_cmd() {
  # GF_PIN_SGLANG=0.5.13,0.5.17: one e2e_gpu.py call per pin, each on its own
  # site (the kit's /tmp/site for 0.5.13, /tmp/site-V unpacked by an earlier
  # GF_SGLANG=V command on this machine); unset: the pin this command runs.
  local v site rc=0 pins=${GF_PIN_SGLANG:-}
  pin_site() { if [ "$1" = "$KIT_SGLANG" ]; then echo /tmp/site; else echo "/tmp/site-$1"; fi; }
  for v in ${pins//,/ }; do
    site=$(pin_site "$v")
    [ -f "$site/.ok" ] || { echo "pin $v: no $site on this machine (see 'Another pin')"; return 1; }
  done
  for v in ${pins//,/ }; do
    site=$(pin_site "$v")
    echo "== pin $v ($site)"
    ( use_site "$site" && pin_e2e "-$v" ) || rc=1
  done
  [ -n "$pins" ] || pin_e2e "" || rc=1
  return $rc
}

pin_e2e() {  # pin_e2e SUFFIX: one e2e_gpu.py call, its JSON and logs named with SUFFIX
  echo "   sglang $(sglang_where)"
  "${E2E[@]}" --configs "${GF_PIN_CONFIGS:-base,native,ours}" \
    --workloads "${GF_PIN_WORKLOADS:-smoke,concurrent,capacity}" --repeats "${GF_PIN_REPEATS:-1}" \
    --inner-repeats "${GF_PIN_INNER:-3}" "${CPU_ARGS[@]}" \
    ${GF_PIN_BASELINE:+--baseline-json "$GF_PIN_BASELINE"} --out "$RUN/pin$1.json" --logs "$RUN/pin$1"
}

kbench_cmd() {
  # GF_KBENCH: which tables (decode,verify by default; overlap: the
  # IndexShare prefetch's replay beside compute, per replay grid).
  local mode
  for mode in ${GF_KBENCH:-decode verify}; do
    case $mode in
      decode) python3 scripts/bench_kernels.py --quick --json "$RUN/kbench_decode.json" ;;
      verify) python3 scripts/bench_kernels.py --verify 2,4 --json "$RUN/kbench_verify.json" ;;
      overlap) python3 scripts/bench_kernels.py --overlap ${GF_OVERLAP_GRIDS:+"$GF_OVERLAP_GRIDS"} --json "$RUN/kbench_overlap.json" ;;
      *) echo "GF_KBENCH: unknown table $mode (decode verify overlap)"; return 2 ;;
    esac
  done
}

bound_cmd() {
  local model; model=$(v32_model "${GF_BOUND_LAYERS:-8}") || return 1
  local syn=${GF_DECODE_SYNTHETIC-calibrated} together=()
  # GF_BOUND_TOGETHER=1: every config's server starts at once (one start-up
  # for all), then the configs take turns, GF_BOUND_INNER rounds.
  [ "${GF_BOUND_TOGETHER:-0}" = 1 ] && together=(--together --inner-repeats "${GF_BOUND_INNER:-1}")
  # GF_MEM_FRACTION (0.6): four 8-layer servers at once hold ~5 GB of
  # weights each; --max-total-tokens caps every pool anyway.
  "${E2E[@]}" --model "$model" --configs "${GF_BOUND_CONFIGS:-base,native,ours,noio}" ${syn:+--synthetic "$syn"} \
    --workloads "${GF_BOUND_WORKLOADS:-decodebound,lone32k}" ${GF_BOUND_NEW:+--max-new "$GF_BOUND_NEW"} \
    --warmup 2 --server-args "--mem-fraction-static ${GF_MEM_FRACTION:-0.6} --cuda-graph-max-bs 16 ${GF_BOUND_SERVER_ARGS:-}" \
    "${together[@]}" ${GF_BOUND_EXTRA:-} "${CPU_ARGS[@]}" --out "$RUN/bound.json" --logs "$RUN/bound"
}

stream_cmd() {
  local together=()
  [ "${GF_STREAM_TOGETHER:-0}" = 1 ] && together=(--together --inner-repeats "${GF_STREAM_INNER:-1}")
  "${E2E[@]}" --configs "${GF_STREAM_CONFIGS:-stream,ours,base}" \
    --workloads "${GF_STREAM_WORKLOAD:-decodebound}" --warmup 2 "${CPU_ARGS[@]}" "${together[@]}" \
    --out "$RUN/stream.json" --logs "$RUN/stream"
}

dsv4_cmd() {
  source scripts/dsv4_env.sh .bundle/dsv4.tar.xz || return 1  # explicit: a sourced file sees the function's $1
  export SGLANG_OPT_FP8_WO_A_GEMM=0
  "${E2E[@]}" "${PAR[@]}" --model "${GF_DSV4_MODEL:-tests/data/tiny-dsv4}" --configs "${GF_DSV4_CONFIGS:-base,ours}" \
    --workloads "${GF_DSV4_WORKLOADS:-smoke}" --check --warmup 0 \
    --hisparse-config "${GF_DSV4_HS:-$HS_DSV4}" \
    --out "$RUN/dsv4.json" --logs "$RUN/dsv4"
}

pd_cmd() {  # the stage's limit in $1 (s): pd_gpu.py keeps ~40 s of it for stopping
  source scripts/mooncake_env.sh .bundle/mooncake.tar.xz || return 1  # explicit: a sourced file sees the function's $1
  echo "mooncake_env: $(python3 -c 'import mooncake.engine as m; print(m.__file__)')"
  # parts v4draft and v4hs serve DeepSeek-V4: tilelang and libz3 from the V4 tarball
  if [[ ,${GF_PD_PARTS:-}, == *,v4draft,* || ,${GF_PD_PARTS:-}, == *,v4hs,* ]]; then
    source scripts/dsv4_env.sh .bundle/dsv4.tar.xz || return 1
  fi
  # GF_PD_SERVER_ARGS: flags for every server (e.g. "--mem-fraction-static 0.6"
  # when more servers than usual share an 80 GB card: see e2e's PARALLEL_MEM_FRACTION)
  python3 scripts/pd_gpu.py --parts "${GF_PD_PARTS:-exact,retract,faults,capacity}" \
    --server-args "${GF_PD_SERVER_ARGS:-}" \
    --budget-s $(( $1 - 40 )) --out "$RUN/pd.json" --logs "$RUN/pd"
}

# `timeout` runs programs, not functions: a stage that needs a function runs
# it in `bash -c` with the function and the variables it reads declared.
for stage in "${STAGES[@]}"; do
  case $stage in
    tests)
      run_stage tests 120 420 bash -c "$(declare -f test_files tests_cmd); WORK='$WORK' RUN='$RUN' tests_cmd"
      show tests ;;
    bg-tests)
      run_stage bg-tests 120 420 bash -c "$(declare -f test_files tests_cmd); WORK='$WORK' RUN='$RUN' tests_cmd" &
      BG_PID=$!
      say "== bg-tests: started in the background (pid $BG_PID)" ;;
    check)
      run_stage check 90 330 "${E2E[@]}" --configs "${GF_CHECK_CONFIGS:-ours}" --workloads concurrent \
        --check --warmup 0 --out "$RUN/check.json" --logs "$RUN/check"
      show check ;;
    fault)
      run_stage fault 90 330 "${E2E[@]}" --configs noio --workloads concurrent \
        --check --warmup 0 --out "$RUN/fault.json" --logs "$RUN/fault"
      show fault ;;
    e2e1|e2e2|e2e)
      wait_bg
      case $stage in
        e2e1) run_stage e2e1 $((80 * ROUND_N)) 480 bash -c "$(declare -f e2e_round); $(declare -p E2E CPU_ARGS REF_CONFIGS REF RUN); e2e_round e2e_round1 $(join $BASE_CONFIG $REF_CONFIGS ours) 1" ;;
        e2e2) run_stage e2e2 $((80 * ROUND_N)) 480 bash -c "$(declare -f e2e_round); $(declare -p E2E CPU_ARGS REF_CONFIGS REF RUN); e2e_round e2e_round2 $(join ours $REF_CONFIGS $BASE_CONFIG) 1" ;;
        e2e)  run_stage e2e $((140 * ROUND_N)) 560 bash -c "$(declare -f e2e_round); $(declare -p E2E CPU_ARGS REF_CONFIGS REF RUN); e2e_round e2e_both $(join $BASE_CONFIG $REF_CONFIGS ours) 2" ;;
      esac
      show "$stage"
      rounds=$(ls "$RUN"/e2e_round1.json "$RUN"/e2e_round2.json 2>/dev/null)
      if [ "$(echo "$rounds" | wc -w)" = 2 ] && [ "$stage" = e2e2 ]; then
        python3 scripts/e2e_gpu.py --merge $rounds --out "$RUN/e2e_merged.json" > "$RUN/e2e_merged.out" 2>&1
        say "== e2e rounds 1+2 merged (e2e_merged.json):"
        sed -n '/^workload    config/,$p' "$RUN/e2e_merged.out" | tee -a "$SUMMARY"
      fi ;;
    deep)
      run_stage deep 150 450 bash -c "$(declare -f deep_cmd); $(declare -p E2E HS_RATIO2 RUN WORK); deep_cmd"
      show deep ;;
    trace)
      run_stage trace 60 240 bash -c "$(declare -f trace_cmd)
trace_cmd"
      show trace ;;
    decode)
      run_stage decode 200 560 bash -c "$(declare -f v32_model decode_cmd); $(declare -p RUN WORK PORT); decode_cmd"
      show decode ;;
    bound)
      run_stage bound 200 560 bash -c "$(declare -f v32_model bound_cmd); $(declare -p E2E CPU_ARGS RUN WORK); bound_cmd"
      show bound ;;
    stream)
      wait_bg
      run_stage stream 200 560 bash -c "$(declare -f stream_cmd); $(declare -p E2E CPU_ARGS RUN); stream_cmd"
      show stream ;;
    mtp)
      run_stage mtp 150 "${GF_MTP_CAP_S:-510}" bash -c "$(declare -f mtp_cmd); $(declare -p E2E PAR RUN); mtp_cmd"
      show mtp ;;
    mtpproof)
      run_stage mtpproof 240 "${GF_MTPPROOF_CAP_S:-540}" bash -c "$(declare -f wait_calls mtpproof_cmd); $(declare -p E2E RUN PORT MTPPROOF_CALLS); mtpproof_cmd"
      show mtpproof ;;
    mtpperf)
      run_stage mtpperf 200 560 bash -c "$(declare -f mtpperf_cmd); $(declare -p E2E CPU_ARGS RUN); mtpperf_cmd"
      show mtpperf ;;
    mtpprof)
      run_stage mtpprof 150 400 bash -c "$(declare -f mtpprof_cmd); $(declare -p RUN PORT); mtpprof_cmd"
      show mtpprof ;;
    pd)
      PD_LEFT=$(( BUDGET_S - $(elapsed) - RESERVE - 45 ))
      run_stage pd 240 560 bash -c "$(declare -f pd_cmd); $(declare -p RUN); pd_cmd $(( PD_LEFT < 560 ? PD_LEFT : 560 ))"
      show pd ;;
    dsv4)
      run_stage dsv4 240 "${GF_DSV4_CAP_S:-540}" bash -c "$(declare -f dsv4_cmd); $(declare -p E2E PAR HS_DSV4 RUN); dsv4_cmd"
      show dsv4 ;;
    kbench)
      wait_bg
      run_stage kbench 90 300 bash -c "$(declare -f kbench_cmd); $(declare -p RUN); kbench_cmd"
      show kbench ;;
    indexshare)
      if [ "${GF_INDEXSHARE_TESTS:-1}" != 0 ]; then
        run_stage indexshare-tests 120 420 bash -c "$(declare -f test_files tests_cmd); WORK='$WORK' RUN='$RUN' GF_TESTS='tests/test_index_share_gpu.py tests/test_kernel_gpu.py::test_copy_planned_replays_the_plan' tests_cmd" &
        IS_TESTS_PID=$!
        say "== indexshare-tests: started in the background (pid $IS_TESTS_PID)"
      fi
      run_stage indexshare "$(indexshare_need_s)" 540 bash -c "$(declare -f wait_calls indexshare_one indexshare_cmd); $(declare -p E2E PAR CPU_ARGS RUN PORT); indexshare_cmd"
      if [ -n "${IS_TESTS_PID:-}" ]; then
        wait "$IS_TESTS_PID"; IS_TESTS_PID=""
        show indexshare-tests
      fi
      show indexshare ;;
    pin)
      wait_bg
      run_stage pin 90 560 bash -c "$(declare -f pin_cmd pin_e2e use_site); $(declare -p E2E CPU_ARGS RUN KIT_SGLANG); pin_cmd"
      show pin ;;
    jit|jitfit) ;;  # done by finish, after everything else
  esac
  say_doctor
done
