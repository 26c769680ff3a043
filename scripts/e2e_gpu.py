#!/usr/bin/env python3
"""End-to-end HiSparse on a GPU: SGLang 0.5.13 servers side by side.

Runs wherever sglang 0.5.13 and this package are importable (e.g. the H200
with the ../shared/gpu bundle: ``source .gpu/device_env.sh`` first). For each
repeat it launches every configuration in turn (alternating, so drift hits
all of them alike), sends the workloads, stops the server, and finally prints
medians, spreads and ratios and writes JSON.

Configurations:
  base    no HiSparse (the whole KV on the GPU)
  native  SGLang 0.5.13's own HiSparse data plane with only our argument
          handling and the decode-crash fix (SGLANG_HISPARSE_NATIVE=1)
  ours    this package's data plane
  nopark  ours with SGLANG_HISPARSE_PARKING=0 (staged requests join at once)
  stream  ours with SGLANG_HISPARSE_STREAMING=1 (the streaming policy: one
          capped prefill batch between two decode steps, parked requests
          before new prompts); "stream" vs "ours" is what it costs in tok/s
          and buys in inter-token gaps
  stream512 ours with SGLANG_HISPARSE_STREAMING=512: streaming with half
          the default prefill cap between two decode steps; beside stream it
          shows what the cap trades (a shorter worst gap against more
          prefill batches and a later first token)
  nostream ours with SGLANG_HISPARSE_STREAMING=0 set explicitly (0.5.13's
          prefill-first order, today's default)
  hold    ours with SGLANG_HISPARSE_STREAMING=hold: 0.5.13's prefill-first
          order, a streamed first token sent with the second (at the
          request's first decode step); beside ours it shows what moving a
          burst's wait into time to first token does to the gaps
  noio    ours with SGLANG_HISPARSE_SKIP_IO=1 (swap-in copies skipped: outputs
          invalid, timing valid; "ours / noio" is what host IO costs)
  sync    ours with SGLANG_HISPARSE_INDEXSHARE_PREFETCH=0: on a model with
          IndexShare layers (--index-pattern) every shared layer swaps in
          synchronously; ours prefetches their misses. With ours, sync and
          noio in one run, an IndexShare table gives ours / noio throughput
          and how much of the sync - noio TPOT gap the prefetch closes
  warp    ours with SGLANG_HISPARSE_PREFETCH_GRID=smx32: the IndexShare
          prefetch replays with one-warp blocks, one per SM (ours: 16
          blocks of 512 threads); with sync and noio in the run the
          IndexShare table gets a row for it beside ours'
  prio16  ours with SGLANG_HISPARSE_PREFETCH_PRIORITY=1 and
          SGLANG_HISPARSE_PREFETCH_GRID=16x512 set explicitly: the prefetch
          stream above the forward's priority and 16 replay blocks of 512
          threads, ours' default since 2026-12-05; an IndexShare row like
          warp's
  prio0   ours with SGLANG_HISPARSE_PREFETCH_PRIORITY=0 and
          SGLANG_HISPARSE_PREFETCH_GRID=smx512: the prefetch at the forward's
          priority with one 512-thread block per SM (the default until
          2026-12-05); an IndexShare row like warp's
  nograph ours with --disable-cuda-graph (every verify / decode step eager)
  nores   ours with SGLANG_HISPARSE_RESIDENCY=0 (every request staged to host
          and decoded from a hot buffer; ours keeps requests resident while
          rows allow, so on short workloads only nores reaches the hot-buffer
          path)
  devgrowth ours with SGLANG_HISPARSE_HOST_GROWTH=0: admission charges the
          running requests' decode growth to GPU rows, as 0.5.13 does (ours
          charges it to host rows; 2026-12-06-s5: 16 x 32K x 6144 out ran at
          most 11 at once under 0.5.13's costing)
  stock   0.5.13 as shipped, plugin not loaded (expected to crash at the
          first decode step)
  bare    base with every plugin but ours (SGLang alone, no HiSparse): what
          a server without this package does, e.g. pd_gpu.py's stock V4 pair
  plain   base without speculative decoding: with --mtp every other
          configuration runs MTP, plain decodes one token a step; its
          outputs are what greedy MTP must reproduce (the summary compares
          every configuration with it as with base)
  base2   a second launch of base: compared with base like every other
          configuration, it shows how far two launches of the same server
          are apart (the control for a logprob step over --tol)
  ref     ours from another copy of the package (--ref-pkg DIR: a
          ``pip install --no-deps --target DIR`` of, e.g., an earlier commit),
          for before/after comparisons in one run; DIR goes first on the
          server's PYTHONPATH and every entry holding this package is dropped

Servers start in an empty directory, not the caller's: ``python -m`` puts
the working directory first on sys.path, so a server started from the
checkout would import the checkout's sglang_hisparse whatever PYTHONPATH
says (and a ``*.egg-info`` left there would load the plugin into base).
The package must be importable from PYTHONPATH (or site-packages), e.g. the
``pip install --no-deps --no-index --target "$TMPDIR/proj" .`` that
.gpu/README.md describes; each configuration's import origin is printed and
written to the JSON before the first launch.

Workloads:
  smoke       600, 3000, 9000 tokens, then a concurrent 7000/8500 pair
  concurrent  16 concurrent 9000-token prompts
  capacity    16 x 16000-token prompts x 128 output tokens sent at once,
              --max-total-tokens 40000
  lone        one 16000-token prompt, 256 output tokens
  decodebound 16 x 32000-token prompts x 1024 output tokens sent at once,
              --max-total-tokens 72000 (base holds two of them, ours a hot
              buffer each): decode dominates. Prints issue #16's target
              lines ("#16 target": ours vs base, native and noio, end to end
              and decode-only; every configuration's gaps)
  decodelong  decodebound with 4096 output tokens at --max-total-tokens
              82000 (base still holds two, up to --max-new 8192): decode
              dominates the wall time, as it does not at 1024-2048 out on
              8 layers. Its own launch; the same "#16 target" lines
  lone32k     one 32000-token prompt x 512 output tokens, decodebound's
              flags (the same launch): the lone-TPOT targets, ours resident
              and nores (no residency: host IO) against base
  decode16k   16 x 16000-token prompts x 512 output tokens, the same flags:
              all 16 decode at once after half decodebound's prefill
  mixed       8 x 32000 and 16 x 4000 tokens x 512 output tokens, same flags
  drain       the abort/retract proof (run_drain): 8 x 9000-token prompts x 192
              output tokens at --max-total-tokens 30000 with 0.5.13's forced
              retraction (SGLANG_TEST_RETRACT=1, every 20 forwards); 4 of them
              are aborted (/abort_request) after 8 streamed tokens, mid-decode
              (under MTP every decode step is a verify step), then,
              once idle, a probe request (600 tokens x 64) whose decode log
              lines must show the pools as the same probe showed them before
              the drain (#gpu token / #cpu token, base: #token, DeepSeek-V4:
              #full token / #swa token; a leaked 9000-token request holds
              >= 4160), retractions > 0, no "memory leak detected" and no
              drift; exit 1 otherwise. DeepSeek-V4 runs it at
              --max-total-tokens 60000 (ARCH_WORKLOAD_FLAGS)
  deep        4 concurrent 12000-token prompts x 64 output tokens,
              --max-total-tokens 60000, CUDA graphs up to batch 4: sized for
              the 61-layer DeepSeek-V3.2-geometry model (31 GB of bf16
              weights; pass --hisparse-config with host_to_device_ratio 2 so
              the pinned host pool stays ~9 GiB)

--model takes a model directory holding only config.json (the kit's
.gpu/tiny-dsv32, or one written by scripts/model_config.py): every server
gets ``--load-format dummy --skip-tokenizer-init`` and is sent input_ids, so
no weights or tokenizer are read (the kit's testweights plugin, on
PYTHONPATH after ``source .gpu/device_env.sh``, re-draws the dummy weights
with a usable scale). The prompts draw token ids below 32768, the kit
config's vocabulary. A DeepSeek-V4 model (config.json naming
DeepseekV4ForCausalLM, e.g. tests/data/tiny-dsv4: the same vocabulary) gets
its own flags, environment and default --hisparse-config (ARCH_FLAGS,
ARCH_ENV, ARCH_HS_CONFIG below); tilelang must be importable (the kit lacks
it: scripts/pack_dsv4.sh, scripts/dsv4_env.sh). --dry-run prints every
launch's command and launches nothing.

--check sets SGLANG_HISPARSE_CHECK=1 in every HiSparse server: the server
compares what each swap-in leaves in the hot buffer with the host copy and
adds ``#exact checked: N, #exact mismatch: M`` (cumulative, one log interval
behind) to its decode log line, and logs ``HiSparse exactness check: first
mismatch ...`` once. After each launch's workloads a short request flushes
the counters; the last ones, whether a first-mismatch line appeared and the
last ``#hisparse miss:`` counter (proof that host reads happened) are
tabulated per launch and written to the JSON's "launches". ours, nopark,
sync, nograph and nores must come out exact, noio (copies skipped: a planted fault) must show
mismatches, and a launch that checked nothing fails; the exit status is 1
when any of them does not hold.

--step-timer loads scripts/steptimer (a diagnostic SGLang plugin, not part
of the package) into each server and prints, per workload, each scheduler
function's wall time per scheduled batch, one column per configuration. It
adds about 0.3 ms of Python per step: compare its columns with each other,
and take TPOT from runs without it.

Stalls: a workload whose server writes no log line for STALL_S (240 s)
while requests are outstanding fails that launch with ServerStalled and
stops the server, instead of waiting out the requests' 600 s timeouts.

Noise: the step time of these tiny-model servers is the scheduler's Python,
so it follows the speed of the core the scheduler lands on. On the lent H200
VM one core ran the same loop up to 1.9x slower than another, and a launch
can sit on a slow core for its whole life or move mid-request (seen as
bimodal decode log rates). Compare configurations over several launches
(``--repeats 3`` or more); ``--cpu-probe`` times a loop on every core first
and prints the spread, so a report can say how noisy the machine was, and
``--cpus fastest:4`` runs every server on the four cores it timed fastest
(the host may still slow a core down later).

--mtp: each request's meta_info ``spec_verify_ct`` (verify steps) and
``spec_accept_length`` (output tokens / verify steps) are recorded, and a
speculative-parity table compares every configuration with base request by
request: a request whose output ids equal base's must have base's verify
count (the same draft proposals accepted at the same steps).

Exactness: greedy outputs with top-2 logprobs; a step counts when both
servers produced the same prefix so far and the baseline's top-1/top-2
margin exceeds --margin; such steps must agree within --tol.

    python scripts/e2e_gpu.py --configs base,ours --workloads smoke,concurrent \
        --repeats 1 --model .gpu/tiny-dsv32 --out results.json
    python scripts/e2e_gpu.py --configs base,ref,ours --ref-pkg .bundle/ref_pkg \
        --workloads capacity,lone --repeats 2
    python scripts/e2e_gpu.py --configs ours,noio --workloads concurrent --check --warmup 0
    python scripts/e2e_gpu.py --model tests/data/tiny-dsv4 --configs base,ours \
        --workloads smoke,concurrent --check --warmup 0      # DeepSeek-V4 (gpu_stages.sh dsv4)
    python scripts/e2e_gpu.py --configs base,ours,nores --workloads smoke --mtp 1,1,2 --check \
        --warmup 0                              # MTP: logprobs, the check, the parity table
    python scripts/e2e_gpu.py --configs nograph --workloads drain --mtp 1,1,2 --check --warmup 0
    python scripts/model_config.py --geometry v32 --layers 61 --out /tmp/dsv32-61
    python scripts/e2e_gpu.py --model /tmp/dsv32-61 --configs ours --workloads deep --check \
        --warmup 0 --server-args "--mem-fraction-static 0.45" \
        --hisparse-config '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2}'

scripts/gpu_stages.sh runs these as stages of one device command.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import NamedTuple, Optional
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

HS_CONFIG = {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}

# What differs by the served model's architecture (model_arch: its
# config.json's "architectures"). DSA models (DeepSeek-V3.2, GLM-5): bf16 KV
# on FlashMLA's sparse kernels (the kit carries no FA3). DeepSeek-V4: SGLang
# forces attention backend dsv4, page 256 and fp8_e4m3 KV
# (srt/arg_groups/deepseek_v4_hook.py) and reads no DSA backend flags; its
# indexer selects 512 compressed (C4, one per 4 tokens) rows, and the hot
# buffer counts C4 rows too: 1024 rows hold 4096 tokens, so longer prompts
# read from host. SGLANG_OPT_FP8_WO_A_GEMM=0: with bf16 dummy weights
# srt/models/deepseek_v4.py asserts when the FP8 W_o GEMM is on (a value
# already in the environment wins). --chunked-prefill-size 2048: SGLang sizes
# V4's SWA pool at 0.1 x the full pool, and a prefill chunk takes SWA slots
# for all its tokens, so under --max-total-tokens 40000 (SWA 3840) the
# default chunk (8192 tokens on the H200) can never be scheduled: base V4 queued the
# capacity workload's 16 prompts and prefilled none for 6 min (2026-12-04-s2).
# --swa-full-tokens-ratio 0.5: nor does 0.5.13 free a prompt's SWA slots
# between its chunks, so a whole prompt must fit the SWA pool; at 0.1 x 40000
# both servers stopped after 3584 tokens of the first 16000-token capacity
# prompt (2026-12-04-s4). 0.5 fits every workload's longest prompt (capacity
# 16000 of 20000, drain 9000 of 15000); SGLang keeps a ratio the command sets.
ARCH_FLAGS = {
    "dsa": ["--kv-cache-dtype", "bfloat16", "--dsa-prefill-backend", "flashmla_sparse",
            "--dsa-decode-backend", "flashmla_sparse"],
    "dsv4": ["--kv-cache-dtype", "fp8_e4m3", "--chunked-prefill-size", "2048",
             "--swa-full-tokens-ratio", "0.5"],
}
ARCH_ENV = {"dsa": {}, "dsv4": {"SGLANG_OPT_FP8_WO_A_GEMM": "0"}}
# A workload's server flags on one architecture, after its own (the last of a
# repeated flag wins). The V4 drain at 30000: ours' halved C4 device pool
# (3712 rows) fits one 9000-token prompt's prefill (2250 rows on the device)
# beside one hot buffer (1088) and no more, so one request ran at a time and
# the forced retraction, which keeps the last running request, retracted
# none (2026-12-06-s2).
ARCH_WORKLOAD_FLAGS = {"dsv4": {"drain": ["--max-total-tokens", "60000"]}}
ARCH_HS_CONFIG = {"dsa": HS_CONFIG,
                  "dsv4": {"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 2}}

# Server flags of the 32K workloads (one launch serves both).
_LONG = ["--max-total-tokens", "72000", "--context-length", "40960"]

WORKLOADS = {
    # name: (list of prompt lengths sent together in groups, output tokens, server extra args)
    "smoke": ([[600], [3000], [9000], [7000, 8500]], 24, []),
    "concurrent": ([[9000] * 16], 32, []),
    "capacity": ([[16000] * 16], 128, ["--max-total-tokens", "40000"]),
    # Same server flags as capacity, so both run on one launch per config.
    "lone": ([[16000]], 256, ["--max-total-tokens", "40000"]),
    # The 61-layer V3.2-geometry model: 4 x 12064 tokens overflow 3 hot
    # buffers of 4160 rows each; only 4 requests, so no larger graphs.
    "deep": ([[12000] * 4], 64, ["--max-total-tokens", "60000", "--cuda-graph-max-bs", "4"]),
    # What HiSparse is for, at fixed HBM: 72000 device rows hold two 32K
    # requests in base; ours holds a hot buffer (4160 rows) per request.
    # Outputs long enough that decode dominates the wall time.
    "decodebound": ([[32000] * 16], 1024, _LONG),
    # One 32K request alone, at decodebound's flags (the same launch): the
    # lone-TPOT targets. Ours keeps it resident (72000 rows hold it); nores
    # (SGLANG_HISPARSE_RESIDENCY=0) serves it from a hot buffer, host IO.
    "lone32k": ([[32000]], 512, _LONG),
    # decodebound with outputs where decode dominates: 4096 tokens, on a
    # pool that holds two base requests whole up to 8192 out (--max-new;
    # 2 x 40192 rows) and never three prompts. At 2048 out the 16 prefills
    # (~15 s on 8 layers) set the end-to-end ratio: the workload's own
    # limit was 2.83x base (2026-12-06-s4).
    "decodelong": ([[32000] * 16], 4096, ["--max-total-tokens", "82000", "--context-length", "40960"]),
    # The same server flags with half the prompt: 16 hot buffers decode at
    # once after half decodebound's prefill (IndexShare's prefetch vs sync
    # vs skip-IO on the V3.2 geometry, where the decode step is GPU-bound).
    "decode16k": ([[16000] * 16], 512, _LONG),
    # The same HBM, long and short requests together.
    "mixed": ([[32000] * 8 + [4000] * 16], 512, _LONG),
    # Aborts and retractions, then a probe: see run_drain.
    "drain": ([[9000] * 8], 192, ["--max-total-tokens", "30000"]),
}
# Server environment a workload's launches get (its own launches: the key
# of a launch is the workload's flags and this).
WORKLOAD_ENV = {"drain": {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "20"}}


class ServerConfig(NamedTuple):
    """What one configuration (the module docstring says what each is for)
    changes in the server it launches, and how its runs are read."""
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment
    args: tuple[str, ...] = ()  # server flags added after every other
    hisparse_flag: bool = True  # launched with --enable-hisparse
    our_plugin: bool = True  # this package loaded (stock and bare: every plugin but ours)
    expect: Optional[str] = None  # what --check must find: this work tree's data plane only
    synthetic: bool = False  # --synthetic's top-k reaches it
    spec_flags: bool = True  # --mtp's EAGLE flags reach it
    indexshare_row: bool = False  # a row of the IndexShare table, beside sync and noio


def _ours(*env: tuple[str, str], args: tuple[str, ...] = (), expect: str = "exact",
          indexshare_row: bool = False) -> ServerConfig:
    """This work tree's data plane with ``env`` set: checked, on the synthetic top-k."""
    return ServerConfig(env=env, args=args, expect=expect, synthetic=True, indexshare_row=indexshare_row)


_STREAMING, _GRID, _PRIORITY = ("SGLANG_HISPARSE_STREAMING", "SGLANG_HISPARSE_PREFETCH_GRID",
                                "SGLANG_HISPARSE_PREFETCH_PRIORITY")
# Every configuration, in the order the tables list them.
SERVER_CONFIGS: dict[str, ServerConfig] = {
    "base": ServerConfig(hisparse_flag=False),
    "native": ServerConfig(env=(("SGLANG_HISPARSE_NATIVE", "1"),), synthetic=True),
    "ref": ServerConfig(),  # its PYTHONPATH: server_cmd
    "ours": _ours(indexshare_row=True),
    "warp": _ours((_GRID, "smx32"), indexshare_row=True),
    "prio16": _ours((_GRID, "16x512"), (_PRIORITY, "1"), indexshare_row=True),
    "prio0": _ours((_GRID, "smx512"), (_PRIORITY, "0"), indexshare_row=True),
    "sync": _ours(("SGLANG_HISPARSE_INDEXSHARE_PREFETCH", "0")),
    "nograph": _ours(args=("--disable-cuda-graph",)),
    "nores": _ours(("SGLANG_HISPARSE_RESIDENCY", "0")),
    "devgrowth": _ours(("SGLANG_HISPARSE_HOST_GROWTH", "0")),
    "nopark": _ours(("SGLANG_HISPARSE_PARKING", "0")),
    "stream": _ours((_STREAMING, "1")),
    "stream512": _ours((_STREAMING, "512")),
    "hold": _ours((_STREAMING, "hold")),
    "nostream": _ours((_STREAMING, "0")),
    "noio": _ours(("SGLANG_HISPARSE_SKIP_IO", "1"), expect="mismatch"),  # a planted fault
    "stock": ServerConfig(our_plugin=False),
    "plain": ServerConfig(hisparse_flag=False, spec_flags=False),
    "base2": ServerConfig(hisparse_flag=False),
    "bare": ServerConfig(hisparse_flag=False, our_plugin=False),
}
CONFIGS = tuple(SERVER_CONFIGS)
# Configurations launched without --enable-hisparse.
WITHOUT_HISPARSE_FLAG = tuple(c for c, s in SERVER_CONFIGS.items() if not s.hisparse_flag)
# Configurations without this package's HiSparse: no --check for them
# (stock runs 0.5.13's own HiSparse, so it still gets --enable-hisparse).
NO_HISPARSE = tuple(c for c, s in SERVER_CONFIGS.items() if not (s.hisparse_flag and s.our_plugin))
# What --check must find in the configurations that run this work tree's
# data plane.
CHECK_EXPECT = {c: s.expect for c, s in SERVER_CONFIGS.items() if s.expect}
CHECK_ENV = "SGLANG_HISPARSE_CHECK"
SYNTHETIC_ENV = "SGLANG_HISPARSE_SYNTHETIC_TOPK"
# Where --synthetic reaches: this work tree's data plane, and SGLang's own
# through the plugin's native-mode hook (adapter/native.py).
SYNTHETIC_CONFIGS = tuple(c for c, s in SERVER_CONFIGS.items() if s.synthetic)
# The IndexShare prefetch configurations, each compared with sync and noio.
PREFETCH_CONFIGS = tuple(c for c, s in SERVER_CONFIGS.items() if s.indexshare_row)


def not_the_models_outputs(synthetic) -> tuple[str, ...]:
    """The configurations whose outputs are not the model's, for summarize:
    skip-IO always, and under a synthetic top-k every configuration it
    reaches. A live run and --merge both ask here."""
    return ("noio",) + (SYNTHETIC_CONFIGS if synthetic else ())

PARALLEL_PORT_STRIDE = 7  # gpu_stages.sh probes ports 30010 + 7k


# --parallel: each server's --mem-fraction-static. Not a share of the GPU:
# SGLang sizes a pool from the memory free after its weights load minus
# (1 - fraction) x what was free before, so the servers starting beside it,
# allocating in between, count against it; a large fraction tolerates them,
# and --max-total-tokens (every workload sets it, 131072 otherwise) caps
# what each pool really takes (2026-12-03: the PD harness ran six servers
# at 0.35 each).
PARALLEL_MEM_FRACTION = "0.6"


STEP_TIMER_DIR = Path(__file__).resolve().parent / "steptimer"


def has_package(entry: str) -> bool:
    """Whether a sys.path entry provides sglang_hisparse (the package or its metadata)."""
    d = Path(entry)
    return ((d / "sglang_hisparse" / "__init__.py").exists()
            or any(d.glob("sglang_hisparse-*.dist-info"))
            or any(d.glob("sglang_hisparse*.egg-info")))


def check_ref_pkg(ref_pkg: str) -> str:
    """--ref-pkg must be a ``pip install --target`` folder: the package and
    the metadata whose entry point SGLang's load_plugins() finds."""
    d = Path(ref_pkg).resolve()
    if not (d / "sglang_hisparse" / "__init__.py").exists():
        raise ValueError(f"--ref-pkg {ref_pkg}: no sglang_hisparse/__init__.py in it")
    eps = [p for p in d.glob("sglang_hisparse-*.dist-info/entry_points.txt")
           if "sglang.srt.plugins" in p.read_text()]
    if not eps:
        raise ValueError(f"--ref-pkg {ref_pkg}: no sglang_hisparse-*.dist-info with a "
                         "sglang.srt.plugins entry point (install it with pip --target)")
    return str(d)


def model_arch(model: str) -> str:
    """"dsv4" for a DeepSeek-V4 model directory, "dsa" for anything else
    (every other model these scripts serve, or a config they cannot read)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "dsa"
    return "dsv4" if "DeepseekV4ForCausalLM" in (cfg.get("architectures") or []) else "dsa"


def mtp_model_and_flags(model: str, logs: Path, spec: str) -> tuple[str, list[str]]:
    """--mtp STEPS,TOPK,NDT: the model to serve (the kit model's config given
    one NextN layer, written under LOGS/model-mtp, when it has none; weights
    are dummy) and the server's EAGLE flags."""
    try:
        steps, topk, ndt = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--mtp takes STEPS,TOPK,NDT (e.g. 3,1,4), got {spec!r}") from None
    cfg = json.loads((Path(model) / "config.json").read_text())
    if not cfg.get("num_nextn_predict_layers"):
        cfg["num_nextn_predict_layers"] = 1
        mtp_model = logs / "model-mtp"
        mtp_model.mkdir(parents=True, exist_ok=True)
        (mtp_model / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        model = str(mtp_model)
    return model, ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
                   "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(ndt)]


def server_cmd(model: str, port: int, config: str, extra: list[str],
               step_timer_out: Optional[Path] = None,
               step_profile: bool = False, hs_config: Optional[dict] = None,
               ref_pkg: Optional[str] = None, check: bool = False,
               server_args: Optional[list[str]] = None,
               synthetic: Optional[str] = None,
               extra_env: Optional[dict] = None,
               spec_flags: Optional[list[str]] = None) -> tuple[list[str], dict]:
    """The server's command line and environment. ``spec_flags`` (--mtp's
    EAGLE flags) reach every configuration but plain."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; allowed: {', '.join(CONFIGS)}")
    if config == "ref" and not ref_pkg:
        raise ValueError("configuration 'ref' needs --ref-pkg DIR")
    arch = model_arch(model)
    env = dict(ARCH_ENV[arch], **os.environ, **(extra_env or {}))
    if step_timer_out is not None:
        # scripts/steptimer is a diagnostic SGLang plugin (see its docstring).
        step_timer_out.mkdir(parents=True, exist_ok=True)
        env["STEPTIMER_OUT"] = str(step_timer_out)
        if step_profile:
            env["STEPTIMER_PROFILE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(STEP_TIMER_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    args = [
        sys.executable, "-m", "sglang.launch_server", "--port", str(port),
        "--host", "127.0.0.1", "--model-path", model, "--load-format", "dummy",
        "--skip-tokenizer-init", "--disable-radix-cache", *ARCH_FLAGS[arch],
        "--disable-piecewise-cuda-graph", "--mem-fraction-static", "0.35",
        "--max-running-requests", "32", "--context-length", "32768",
        "--skip-server-warmup", "--random-seed", "0", "--decode-log-interval", "4",
        # 16 concurrent requests at most: capturing graphs up to 256 only
        # lengthens every launch.
        "--cuda-graph-max-bs", "32",
        # Each streamed event carries only its new tokens (stream_generate
        # adds them up). Cumulative events carry the whole output with
        # logprobs and top-2, O(n) per event to build and parse: 16 streams
        # of 2048 tokens got 0.25 events per token to the client
        # (2026-12-06-s4, ours on decodebound), so the gaps it measured
        # were between merged events, not between tokens.
        "--incremental-streaming-output",
        # SGLang's tokenizer manager logs each garbage collection in it
        # over this long. On 2026-12-07-s10 the streams of ours and hold
        # paused ~740 ms together at the same token of the same round while
        # the scheduler's decode log ran on without a gap: something
        # between the scheduler and the client, in two servers at one
        # point of an identical history, which a full collection would be.
        # The logged pauses (log_stats' long_gc_*) say whether it was.
        "--gc-warning-threshold-secs", "0.1",
    ]
    row = SERVER_CONFIGS[config]
    if not row.spec_flags:
        spec_flags = None
    # later flags win in SGLang's argparse
    extra = list(extra) + list(spec_flags or []) + list(server_args or [])
    if "--max-total-tokens" not in extra:
        args += ["--max-total-tokens", "131072"]
    args += extra
    if row.hisparse_flag:
        args += ["--enable-hisparse", "--hisparse-config", json.dumps(hs_config or ARCH_HS_CONFIG[arch])]
    if check and config not in NO_HISPARSE:
        env[CHECK_ENV] = "1"
    if synthetic and row.synthetic:
        env[SYNTHETIC_ENV] = synthetic
    if config == "ref":
        # The other copy first; no entry that would give this work tree's
        # package (or its entry point) instead.
        kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not has_package(p)]
        env["PYTHONPATH"] = os.pathsep.join([ref_pkg] + kept)
    env.update(row.env)
    args += list(row.args)
    if not row.our_plugin:
        # SGLang's own whitelist: every plugin but ours (test weights stay),
        # the diagnostic ones this command puts on the server's PYTHONPATH too.
        from importlib.metadata import distributions, entry_points

        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        names = {ep.name for ep in entry_points(group="sglang.srt.plugins")}
        names |= {ep.name for dist in distributions(path=paths) for ep in dist.entry_points
                  if ep.group == "sglang.srt.plugins"}
        others = names - {"sglang_hisparse"}
        env["SGLANG_PLUGINS"] = ",".join(sorted(others)) or "__none__"
    return args, env


def cpu_core_speeds(loops: int = 3_000_000) -> dict[int, float]:
    """Seconds one Python loop takes pinned to each core (one after another,
    so they do not compete)."""
    code = ("import os, sys, time\n"
            "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
            "t = time.perf_counter(); s = 0\n"
            f"for i in range({loops}): s += i\n"
            "print(time.perf_counter() - t)\n")
    speeds = {}
    for core in sorted(os.sched_getaffinity(0)):
        out = subprocess.run([sys.executable, "-c", code, str(core)], capture_output=True,
                             text=True, timeout=120)
        if out.returncode == 0:
            speeds[core] = float(out.stdout.strip())
    return speeds


def describe_core_speeds(speeds: dict[int, float]) -> str:
    if not speeds:
        return "cpu probe: no core could be timed"
    fast, slow = min(speeds.values()), max(speeds.values())
    cores = " ".join(f"{c}:{t * 1000:.0f}" for c, t in sorted(speeds.items()))
    return (f"cpu probe (ms per loop, core:ms): {cores}; slowest / fastest = "
            f"{slow / fast:.2f}")


def choose_cpus(spec: str, speeds: dict[int, float]) -> set[int]:
    """``--cpus``: a comma list of cores, or ``fastest:N`` (the N cores the
    probe timed fastest)."""
    if spec.startswith("fastest:"):
        n = int(spec.split(":", 1)[1])
        if not 1 <= n <= len(speeds):
            raise ValueError(f"--cpus fastest:N needs N in [1, {len(speeds)}], got {n}")
        return set(sorted(speeds, key=speeds.get)[:n])
    cpus = {int(c) for c in spec.split(",") if c.strip()}
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"--cpus must name cores among {sorted(allowed)}, got {spec!r}")
    return cpus


def pin_to(cpus):
    """A ``preexec_fn`` that confines the server (and every process it
    starts) to ``cpus``; None leaves it where the OS puts it."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


# Process groups of the servers running now (Server adds, Server.stop
# removes): what the SIGTERM handler signals at once.
LIVE_SERVER_GROUPS: set[int] = set()


def exit_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from ``timeout``) into SystemExit, so that the
    ``finally`` blocks stop the servers: a server left running keeps its
    port and GPU memory and spoils every later launch on the machine.
    Every live server is sent SIGTERM first, all at once: the finally
    blocks stop servers one after the other, up to 30 s each, and
    ``timeout -k`` kills this process before six of them are through
    (2026-12-06-s4: five servers of a cut-off --together run outlived it,
    held 58 GB of the GPU and the host's pinned memory, and the next
    command's servers were killed at start-up)."""
    def handler(signum, frame):
        for group in list(LIVE_SERVER_GROUPS):
            try:
                os.killpg(group, signal.SIGTERM)
            except OSError:
                pass  # gone already
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


_SERVER_CWD: Optional[str] = None


def server_cwd() -> str:
    """An empty directory to start servers in (see the module docstring)."""
    global _SERVER_CWD
    if _SERVER_CWD is None:
        import atexit
        import shutil
        import tempfile

        _SERVER_CWD = tempfile.mkdtemp(prefix="e2e_server_cwd_")
        atexit.register(shutil.rmtree, _SERVER_CWD, True)
    return _SERVER_CWD


_ORIGIN_PROBE = (
    "import importlib.util as u, importlib.metadata as m\n"
    "s = u.find_spec('sglang_hisparse')\n"
    "try:\n"
    "    d = m.distribution('sglang-hisparse'); v = d.version\n"
    "except m.PackageNotFoundError:\n"
    "    v = None\n"
    "eps = [e.value for e in m.entry_points(group='sglang.srt.plugins') if e.name == 'sglang_hisparse']\n"
    "print(repr((s.origin if s else None, v, eps[0] if eps else None)))\n")


def package_origin(env: dict) -> dict:
    """Where a server with ``env`` imports sglang_hisparse from, its
    distribution's version and the plugin entry point it would load."""
    out = subprocess.run([sys.executable, "-c", _ORIGIN_PROBE], env=env, cwd=server_cwd(),
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-300:]}
    import ast

    origin, version, ep = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return {"origin": origin, "version": version, "entry_point": ep}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, poll_s: float = 1.0) -> float:
    """Seconds until ``url``'s /health answers 200; raises when ``proc`` (the
    server) exits first or ``timeout`` passes."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited rc={proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except Exception:
            pass
        time.sleep(poll_s)
    raise TimeoutError("server not ready")


class Server:
    def __init__(self, model, port, config, extra, log_path, step_timer_out=None, cpus=None,
                 step_profile=False, **opts):
        cmd, env = server_cmd(model, port, config, extra, step_timer_out, step_profile, **opts)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=pin_to(cpus),
                                     cwd=server_cwd())
        LIVE_SERVER_GROUPS.add(self.proc.pid)

    def wait_ready(self, timeout=420):
        return wait_healthy(self.url, self.proc, timeout)

    def terminate(self):
        """Ask the server's process group to exit (stop() waits for it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except OSError:
            pass  # exited already

    def stop(self):
        self.terminate()
        try:
            self.proc.wait(timeout=30)
        except Exception:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except Exception:
                pass
        LIVE_SERVER_GROUPS.discard(self.proc.pid)
        self.log.close()


def step_timer_snapshot(out: Optional[Path]) -> dict:
    """{function: [seconds, calls]} summed over the server's scheduler processes."""
    total: dict = {}
    if out is None:
        return total
    for path in out.glob("steptimer_*.json"):
        try:
            stats = json.loads(path.read_text())["stats"]
        except (OSError, ValueError, KeyError):
            continue
        for name, (sec, calls) in stats.items():
            t = total.setdefault(name, [0.0, 0])
            t[0] += sec
            t[1] += calls
    return total


def step_timer_diff(before: dict, after: dict) -> dict:
    return {k: [v[0] - before.get(k, [0.0, 0])[0], v[1] - before.get(k, [0.0, 0])[1]]
            for k, v in after.items() if v[1] > before.get(k, [0.0, 0])[1]}


def make_ids(n: int, seed: int, vocab: int = 32768) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]


def stream_generate(url: str, ids: list[int], max_new: int, timeout: float = 600) -> dict:
    """One streaming /generate; returns token ids, top-2 logprobs and timings."""
    return parse_stream(read_stream(url, ids, max_new, timeout))


def read_stream(url: str, ids: list[int], max_new: int, timeout: float = 600) -> dict:
    """One streaming /generate, read as it arrives: each event's arrival time
    and its bytes, nothing parsed (``parse_stream`` makes the request's
    result). A workload's requests stream on threads of this one process.
    When each thread parsed its events and built its result as its stream
    ended, the threads that ended first held the interpreter while the rest
    were still receiving: a stand-in server that ends 8 of 16 streams one
    4.5 ms tick before the others showed gaps of 12-19x the median at the
    last tokens on this CPU (2026-12-07-s6), the run-end gaps of 2026-12-07-s5's
    hold config (scheduler sends 18 ms apart, client gaps 40-90 ms). So a
    workload parses after all of its streams have ended."""
    body = json.dumps({
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 2, "stream": True,
    }).encode()
    req = urllib.request.Request(url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    stamps, events = [], []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            if raw.startswith(b"data:") and not raw.startswith(b"data: [DONE]"):
                stamps.append(time.time() - t0)
                events.append(raw)
    return {"prompt_len": len(ids), "t0": t0, "stamps": stamps, "events": events}


def parse_stream(raw: dict) -> dict:
    """A request's result from ``read_stream``'s events."""
    stamps = raw["stamps"]
    last = None
    # Every server runs with --incremental-streaming-output: an event holds
    # its new tokens and their logprobs; the scalars (finish reason,
    # speculative counts) are the request's so far.
    output_ids, token_logprobs, top = [], [], []
    for line in raw["events"]:
        last = json.loads(line[5:])
        mi = last.get("meta_info") or {}
        output_ids += last.get("output_ids") or []
        token_logprobs += mi.get("output_token_logprobs") or []
        top += mi.get("output_top_logprobs") or []
    mi = (last or {}).get("meta_info") or {}
    out = {
        "prompt_len": raw["prompt_len"],
        "t0": raw["t0"],  # wall clock at the send (a step timer's timeline shares it)
        "output_ids": output_ids,
        "logprobs": [x[0] for x in token_logprobs],
        "top2": [[t[0] for t in step[:2]] if step else [] for step in top],
        "ttft": stamps[0] if stamps else None,
        "e2e": stamps[-1] if stamps else None,
        "finish_reason": mi.get("finish_reason"),
        # speculative decoding (0.5.13 tokenizer_manager: absent without it)
        "spec_verify_ct": mi.get("spec_verify_ct"),
        "spec_accept_length": mi.get("spec_accept_length"),
    }
    n = len(out["output_ids"] or [])
    if n > 1 and out["ttft"] is not None:
        out["tpot_ms"] = 1000 * (out["e2e"] - out["ttft"]) / (n - 1)
    # Inter-token gaps after the first token (a parked request shows as one
    # long gap between tokens it was promised).
    out["gaps_ms"] = [round(1000 * (b - a), 3) for a, b in zip(stamps, stamps[1:])]
    return out


def gap_stats(requests: list[dict]) -> dict:
    """p50/p99 of every inter-token gap of a run, the worst ratio of one
    request's longest gap to its own median gap, and the median of the
    requests' first gaps (first token to second: where a request waits to
    join the decode batch, the worst gap of every configuration on
    2026-12-06)."""
    gaps = sorted(g for r in requests for g in r.get("gaps_ms") or [])
    if not gaps:
        return {"itg_p50_ms": None, "itg_p99_ms": None, "itg_worst_over_median": None,
                "itg_first_p50_ms": None}
    worst = max((max(r["gaps_ms"]) / max(statistics.median(r["gaps_ms"]), 1e-3)
                 for r in requests if r.get("gaps_ms")), default=None)
    return {"itg_p50_ms": gaps[len(gaps) // 2],
            "itg_p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "itg_worst_over_median": worst,
            "itg_first_p50_ms": statistics.median(r["gaps_ms"][0] for r in requests
                                                  if r.get("gaps_ms"))}


def add_rates(res: dict, t0: float) -> dict:
    """A workload's rates from its requests (``res["requests"]``), begun at ``t0``."""
    res["wall_s"] = time.time() - t0
    out_tokens = sum(len(r["output_ids"] or []) for r in res["requests"])
    res["output_tok_s"] = out_tokens / res["wall_s"] if res["wall_s"] else 0.0
    tpots = [r["tpot_ms"] for r in res["requests"] if "tpot_ms" in r]
    res["mean_tpot_ms"] = statistics.mean(tpots) if tpots else None
    # A lone request's time to first token is its prefill time: 16 of them
    # bound how fast the capacity workload can go, whatever the batch.
    ttfts = [r["ttft"] for r in res["requests"] if r.get("ttft") is not None]
    res["median_ttft_s"] = statistics.median(ttfts) if ttfts else None
    res.update(gap_stats(res["requests"]))
    return res


# A server that writes nothing to its log for this long while requests are
# outstanding has stalled: 2026-12-04-s2's base V4 queued 16 prompts it could
# never prefill and the stage waited out its whole limit (462 s). Generous,
# since a cold first request can compile kernels for minutes (SGLang logs
# each prefill batch, and a decode line every 40 steps).
STALL_S = 240.0


class ServerStalled(RuntimeError):
    pass


def _results_or_stall(futs, log_path: Optional[Path], stall_s: float, res: dict,
                      finish=lambda r: r) -> None:
    """Collect the futures' results, each through ``finish`` once all have
    ended, into ``res`` in submission order (the comparisons with base pair
    requests by position); raise ServerStalled when ``log_path`` stops
    growing for ``stall_s`` with some still pending."""
    pending = set(futs)
    size, since = (log_path.stat().st_size if log_path else 0), time.time()
    while pending:
        _, pending = wait(pending, timeout=5.0)
        if log_path is None or not pending:
            continue
        now = log_path.stat().st_size
        if now != size:
            size, since = now, time.time()
        elif time.time() - since > stall_s:
            raise ServerStalled(f"no server log line for {stall_s:.0f} s with {len(pending)} "
                                f"of {len(futs)} requests outstanding ({log_path.name})")
    for f in futs:
        try:
            res["requests"].append(finish(f.result()))
        except Exception as exc:
            res["errors"].append(repr(exc))


def run_workload(url: str, name: str, seed0: int = 0, max_requests: Optional[int] = None,
                 max_new: Optional[int] = None, log_path: Optional[Path] = None,
                 stall_s: float = STALL_S, prompts: Optional[list] = None) -> dict:
    """A workload's groups, one after the other, each group's requests at
    once (``prompts``: other groups of prompt lengths, with the workload's
    output length). With ``log_path`` (the server's log) a stalled server raises
    ServerStalled instead of holding the command until its requests time
    out; the caller stops the server, which ends the requests."""
    groups, default_new, _ = WORKLOADS[name]
    groups = prompts or groups
    max_new = max_new or default_new
    if max_requests:
        groups = [lens[:max_requests] for lens in groups]
    res = {"requests": [], "errors": []}
    with client_gc_paused():
        t0 = time.time()
        for gi, lens in enumerate(groups):
            ids = [make_ids(n, seed0 + 1000 * gi + k) for k, n in enumerate(lens)]
            ex = ThreadPoolExecutor(len(ids))
            try:
                futs = [ex.submit(read_stream, url, x, max_new) for x in ids]
                _results_or_stall(futs, log_path, stall_s, res, finish=parse_stream)
            finally:
                # Not waiting: after a stall the requests end when the server does.
                ex.shutdown(wait=False)
        return add_rates(res, t0)


@contextlib.contextmanager
def client_gc_paused():
    """This process's garbage collector off while a workload streams.
    Parsing the streams allocates, and each full collection walks every run
    kept so far (ids, logprobs, top-2 per token): the client's own pauses
    landed in the inter-token gaps it measures, longer for each
    configuration that ran later in the command (2026-12-06-s4, cumulative
    events, lone32k: periodic spikes of 20, 35, 50, 60, 77 ms in run order;
    a stand-in server in another process, streaming every 3 ms: worst gap
    12 -> 38 ms as the stored runs grew with the collector on, 6-9 ms with
    it off). A run's reference cycles wait for the collection after it."""
    was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def flush_counters(url: str) -> None:
    """A short request after the workloads: its decode log lines carry the
    counters of the steps before them (they trail by one interval)."""
    try:
        stream_generate(url, make_ids(600, 4242), 16, timeout=120)
        time.sleep(0.5)
    except Exception as exc:
        print(f"counter flush request failed: {exc!r}", flush=True)


# --- the drain workload ------------------------------------------------------
DRAIN_ABORTS, DRAIN_ABORT_AFTER_TOKENS = 4, 8
PROBE_LEN, PROBE_NEW = 600, 64
PROBE_PAGES = -(-(PROBE_LEN + PROBE_NEW) // 64) * 64
# The pools after the drain hold the probe alone: the same probe sent before
# the drain shows what that is (its KV, its spec reserve, a hot buffer grown
# to it and, for ours on DeepSeek-V4, the constant part of "#full token":
# SGLang computes it from our full_available_size, which is capped by the
# halved C4 device pool, so it reads 15104 with nothing running at
# --max-total-tokens 30000; 2026-12-06-s2). Any request of the drain left
# behind would hold >= 4160 rows (a long request's hot buffer) and >= 9024
# host rows more. Without a reading before (no decode line), the pools must
# fit twice the probe's pages.
DRAIN_POOL_BOUND = 2 * PROBE_PAGES


def abort_after(url: str, ids: list[int], max_new: int, tokens: int, rid: str) -> dict:
    """A streaming request aborted through the server's /abort_request once
    ``tokens`` outputs have streamed (mid-decode: under MTP every decode step
    is a verify step); reads its stream to the end. Returns the outputs
    streamed and the finish reason."""
    body = json.dumps({"input_ids": ids, "stream": True, "rid": rid,
                       "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                           "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    seen, last, outputs = 0, None, 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            last = json.loads(line[5:])
            outputs += len(last.get("output_ids") or [])  # incremental events
            seen += 1
            if seen == tokens:
                abort = urllib.request.Request(
                    url + "/abort_request", data=json.dumps({"rid": rid}).encode(),
                    headers={"Content-Type": "application/json"})
                urllib.request.urlopen(abort, timeout=30).close()
    reason = (last or {}).get("meta_info", {}).get("finish_reason")
    return {"streamed": seen, "output_tokens": outputs, "finish_reason": reason}


# The pools a decode log line reports: DSA ours "#gpu token" / "#cpu token",
# DSA base "#token", DeepSeek-V4 "#full token" and "#swa token" (both
# configs; ours adds the DSA pair for its C4 rows).
DRAIN_POOL_FIELDS = ("#gpu token", "#cpu token", "#token", "#full token", "#swa token")
_FIELD = {key: re.compile(rf"{re.escape(key)}: (\d+)") for key in
          (*DRAIN_POOL_FIELDS, "#running-req", "#hisparse drift")}


def decode_line_max(text: str, key: str) -> Optional[int]:
    """The largest value of a decode log field in ``text`` (None: absent)."""
    vals = [int(m.group(1)) for line in text.splitlines() if "Decode batch" in line
            for m in [_FIELD[key].search(line)] if m]
    return max(vals) if vals else None


def send_probe(url: str, log_path: Path, res: dict) -> tuple[Optional[dict], dict]:
    """The drain's probe request, and the pools its decode log lines show."""
    mark = log_path.stat().st_size
    probe = None
    try:
        probe = stream_generate(url, make_ids(PROBE_LEN, 4243), PROBE_NEW, timeout=180)
    except Exception as exc:
        res["errors"].append(f"probe: {exc!r}")
    time.sleep(1.0)  # its last decode line reaches the log
    after = log_path.read_text(errors="ignore")[mark:]
    return probe, {key: decode_line_max(after, key) for key in DRAIN_POOL_FIELDS}


def pools_as_before(before: dict, after: dict) -> bool:
    """Every pool the probe's lines show after the drain at most what they
    showed before it (the absolute bound where no line came before)."""
    held = {k: v for k, v in after.items() if v is not None}
    if not held:
        return False
    if not any(v is not None for v in before.values()):
        return max(held.values()) <= DRAIN_POOL_BOUND
    return all(before.get(k) is not None and v <= before[k] for k, v in held.items())


def run_drain(url: str, log_path: Path, max_new: Optional[int] = None) -> dict:
    """The drain workload (see the module docstring): what completed, what
    the server logged while it ran, and the pools as the probe's decode log
    lines show them once everything else is gone, against the same probe's
    before the drain."""
    groups, default_new, _ = WORKLOADS["drain"]
    max_new = max_new or default_new
    lens = groups[0]
    ids = [make_ids(n, 5000 + k) for k, n in enumerate(lens)]
    res = {"requests": [], "errors": []}
    _, pools_before = send_probe(url, log_path, res)
    start = log_path.stat().st_size
    t0 = time.time()
    with ThreadPoolExecutor(len(ids)) as ex:
        hang = [ex.submit(abort_after, url, x, max_new, DRAIN_ABORT_AFTER_TOKENS, f"drain-abort-{k}")
                for k, x in enumerate(ids[:DRAIN_ABORTS])]
        full = [ex.submit(stream_generate, url, x, max_new) for x in ids[DRAIN_ABORTS:]]
        for f in full:
            try:
                res["requests"].append(f.result())
            except Exception as exc:
                res["errors"].append(repr(exc))
        seen = []
        for f in hang:
            try:
                seen.append(f.result())
            except Exception as exc:
                res["errors"].append(repr(exc))
    add_rates(res, t0)
    time.sleep(3.0)  # the aborts reach the scheduler; it goes idle
    during = log_path.read_text(errors="ignore")[start:]
    probe, pools = send_probe(url, log_path, res)
    text = log_path.read_text(errors="ignore")
    retracts = (re.findall(r"Retract requests\. #retracted_reqs: (\d+)", during)
                + re.findall(r"Testing retraction\. #retracted_reqs: (\d+)", during))
    drift = decode_line_max(text[start:], "#hisparse drift")
    verdict = {
        "completed": len(res["requests"]), "expected": len(lens) - DRAIN_ABORTS,
        # aborted with fewer outputs than asked for (0.5.13 names it "abort")
        "aborted": sum(1 for x in seen if x["output_tokens"] < max_new),
        "aborts": seen,
        "retractions": sum(int(x) for x in retracts), "retraction_events": len(retracts),
        "probe_ok": bool(probe and len(probe["output_ids"] or []) == PROBE_NEW),
        "probe_pools": pools, "probe_pools_before": pools_before, "pool_bound": DRAIN_POOL_BOUND,
        "memory_leak_lines": text[start:].count("memory leak detected"),
        # counted as log_stats counts them: 0.5.13's benign start-up line
        # never does (it comes before the drain's mark today)
        "drift": drift, "traceback": count_tracebacks(text[start:])["other"] > 0,
    }
    verdict["pools_back"] = pools_as_before(pools_before, pools)
    # SGLang's forced retraction keeps the last running request: with one
    # running at a time it logs events that retract nothing (V4 at 30000).
    verdict["ok"] = (verdict["pools_back"] and verdict["probe_ok"]
                     and verdict["completed"] == verdict["expected"]
                     and verdict["aborted"] == DRAIN_ABORTS
                     and verdict["retractions"] > 0 and not verdict["memory_leak_lines"]
                     and not drift and not verdict["traceback"])
    res["drain"] = verdict
    return res


def summarize_drain(results, configs) -> list[dict]:
    """One row per launch of the drain workload."""
    rows = [dict(config=c, **r["drain"]) for c in configs
            for r in results.get(c, {}).get("drain", []) if r.get("drain")]
    if not rows:
        return rows
    print(f"\ndrain ({DRAIN_ABORTS} aborted mid-decode, forced retraction, then a "
          f"{PROBE_LEN}-token probe; pools at most the same probe's before the drain)")
    for x in rows:
        print(f"drain {x['config']:<8} completed {x['completed']}/{x['expected']}, aborted "
              f"{x['aborted']}/{DRAIN_ABORTS} mid-decode, retractions "
              f"{x['retractions']} in {x['retraction_events']} events, probe "
              f"{'ok' if x['probe_ok'] else 'FAILED'}, pools after {x['probe_pools']} "
              f"(before {x.get('probe_pools_before')}), "
              f"leak lines {x['memory_leak_lines']}, drift {x['drift'] or 0}"
              f"{', TRACEBACK' if x['traceback'] else ''}: {'OK' if x['ok'] else 'FAILED'}",
              flush=True)
    return rows


# Issue #17's performance targets, both servers with MTP: a lone (resident)
# request's TPOT within 1.05x base's, the capacity workload at >= 2x base's
# output rate.
MTP_TARGETS = {("lone", "tpot_vs_base"): ("<=", 1.05), ("capacity", "tok_s_vs_base"): (">=", 2.0)}


def judge_target(w: str, c: str, key: str, value: float, op: str, target: float, runs: int) -> dict:
    """One target's row: ``value`` (a ratio of ``c`` on workload ``w``)
    against ``op target``."""
    met = value <= target if op == "<=" else value >= target
    return {"workload": w, "config": c, "ratio": key, "value": value,
            "target": f"{op} {target}", "met": met, "runs": runs}


def summarize_mtp_targets(summary: list[dict], config: str = "ours") -> list[dict]:
    """The MTP targets from summary rows (medians over runs)."""
    rows = []
    for (w, key), (op, target) in MTP_TARGETS.items():
        row = next((r for r in summary if r["workload"] == w and r["config"] == config), None)
        if row is None or row.get(key) is None:
            continue
        rows.append(judge_target(w, config, key, row[key], op, target, row["runs"]))
        print(f"mtp target {w:<9} {config} {key} {row[key]:.3f} (target {op} {target}: "
              f"{'met' if rows[-1]['met'] else 'NOT met'}; {row['runs']} run(s))", flush=True)
    return rows


# Issue #16's targets, each (workload, config, table, ratio): op, value.
# Table "summary" is the end-to-end row, "decode" the decode-only and gap
# row. ours / noio is >= 0.9 with the calibrated top-k, >= 0.8 on the random
# weights' own (REALISTIC_NOIO). The decode-only targets are the issue's at
# 61 layers; at other depths they are printed for comparison.
_DECODE_BOUND_TARGETS = {
    ("summary", "tok_s_vs_base"): (">=", 3.0),
    ("summary", "tok_s_vs_native"): (">=", 1.5),
    ("summary", "tok_s_vs_noio"): (">=", None),
    ("decode", "decode_only_vs_base"): (">=", 4.0),
    ("decode", "decode_only_vs_native"): (">=", 2.0),
}
REALISTIC_TARGETS = {(w, "ours", table, key): target for w in ("decodebound", "decodelong")
                     for (table, key), target in _DECODE_BOUND_TARGETS.items()}
REALISTIC_TARGETS.update({
    ("lone32k", "ours", "summary", "tpot_vs_base"): ("<=", 1.05),
    ("lone32k", "nores", "summary", "tpot_vs_base"): ("<=", 1.15),
})
REALISTIC_NOIO = {"calibrated": 0.9, None: 0.8}
# Streaming, every configuration of every workload with gap statistics: a
# request's worst gap within 10 x its own median gap, p99 within 3 x TPOT.
STREAM_TARGETS = {"itg_worst_over_median": 10.0, "itg_p99_over_tpot": 3.0}


def summarize_realistic_targets(summary: list[dict], decode: list[dict],
                                synthetic: Optional[str]) -> list[dict]:
    """Issue #16's targets from the summary and decode tables (medians over
    runs), one printed line each; nothing for a ratio the run lacks."""
    tables = {"summary": summary, "decode": decode}
    ends = {(r["workload"], r["config"]): r for r in summary}  # end-to-end rows
    rows = []

    def judge(w, c, key, value, op, target):
        rows.append(judge_target(w, c, key, value, op, target, ends.get((w, c), {}).get("runs", 0)))
        print(f"#16 target {w:<11} {c:<9} {key} {value:.3f} (target {op} {target:g}: "
              f"{'met' if rows[-1]['met'] else 'NOT met'}; {rows[-1]['runs']} run(s))", flush=True)

    for (w, c, table, key), (op, target) in REALISTIC_TARGETS.items():
        row = next((r for r in tables[table] if r["workload"] == w and r["config"] == c), None)
        if row is None:
            continue
        value = row.get(key)
        if key == "tok_s_vs_noio":
            target = REALISTIC_NOIO.get(synthetic, REALISTIC_NOIO[None])
            n = ends.get((w, "noio"), {}).get("output_tok_s")
            value = row["output_tok_s"] / n if n and row.get("output_tok_s") else None
        if value is not None:
            judge(w, c, key, value, op, target)
    for row in decode:
        for key, target in STREAM_TARGETS.items():
            if row.get(key) is not None:
                judge(row["workload"], row["config"], key, row[key], "<=", target)
    return rows


def spec_parity(base: dict, other: dict) -> dict:
    """Per request (same prompts, same order): verify counts and accept
    lengths against base's; a request whose output ids equal base's must
    have base's verify count."""
    out = {"requests": 0, "identical_outputs": 0, "verify_ct_equal": 0,
           "identical_but_verify_ct_differs": 0, "max_abs_d_accept_length": 0.0,
           "verify_ct": [], "base_verify_ct": []}
    for a, b in zip(base["requests"], other["requests"]):
        va, vb = a.get("spec_verify_ct"), b.get("spec_verify_ct")
        if va is None or vb is None:
            continue
        out["requests"] += 1
        same = (a["output_ids"] or []) == (b["output_ids"] or [])
        out["identical_outputs"] += same
        out["verify_ct_equal"] += va == vb
        out["identical_but_verify_ct_differs"] += same and va != vb
        out["max_abs_d_accept_length"] = max(out["max_abs_d_accept_length"], abs(
            (a.get("spec_accept_length") or 0) - (b.get("spec_accept_length") or 0)))
        out["base_verify_ct"].append(va)
        out["verify_ct"].append(vb)
    return out


def summarize_spec(results, configs, workloads) -> list[dict]:
    """--mtp: every configuration's verify counts and accept lengths against
    base's, request by request, per workload (all runs pooled)."""
    rows = []
    for w in workloads:
        base_runs = results.get("base", {}).get(w, [])
        for c in configs:
            runs = results[c][w]
            acc = [q.get("spec_accept_length") for r in runs for q in r["requests"]
                   if q.get("spec_accept_length") is not None]
            row = {"workload": w, "config": c,
                   "mean_accept_length": statistics.mean(acc) if acc else None}
            if c not in ("base", "plain") and base_runs:  # plain runs no speculation
                parts = [spec_parity(b, o) for b, o in zip(base_runs, runs)]
                for k in ("requests", "identical_outputs", "verify_ct_equal",
                          "identical_but_verify_ct_differs"):
                    row[k] = sum(x[k] for x in parts)
                row["max_abs_d_accept_length"] = max(
                    (x["max_abs_d_accept_length"] for x in parts), default=None)
                row["verify_ct"] = [v for x in parts for v in x["verify_ct"]]
                row["base_verify_ct"] = [v for x in parts for v in x["base_verify_ct"]]
                row["parity_ok"] = bool(row["requests"]) and not row["identical_but_verify_ct_differs"]
            rows.append(row)
    if not any(r["mean_accept_length"] is not None for r in rows):
        return rows
    print("\nspeculative parity vs base (meta_info spec_verify_ct / spec_accept_length, "
          "request by request)")
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        line = f"spec {r['workload']:<11} {r['config']:<8} accept length {f(r['mean_accept_length'])}"
        if "requests" in r:
            line += (f", verify_ct equal {r['verify_ct_equal']}/{r['requests']} "
                     f"(identical outputs {r['identical_outputs']}, of them with another "
                     f"verify_ct {r['identical_but_verify_ct_differs']}), max |d accept length| "
                     f"{f(r['max_abs_d_accept_length'])}, verify_ct {r['verify_ct']} vs base "
                     f"{r['base_verify_ct']}: {'parity' if r['parity_ok'] else 'NO PARITY'}")
        print(line, flush=True)
    return rows


_RUNNING = re.compile(r"Decode batch.*?#running-req: (\d+)")
_PREFILL = re.compile(r"Prefill batch.*?#new-token: (\d+).*?input throughput \(token/s\): ([\d.]+)")
# A prefill log line's rate is its tokens over the time since the previous
# prefill line; lines this size or more are chunks of long prompts.
PREFILL_RATE_MIN_TOKENS = 1024
_DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")


_RETRACTED = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
_EXACT = re.compile(r"#exact checked: (\d+)[,;]?\s*#exact mismatch: (\d+)")
FIRST_MISMATCH = "HiSparse exactness check: first mismatch"


def exact_counters(text: str) -> dict:
    """The exactness check's last cumulative counters in a log (None where
    the server printed none) and its first-mismatch line, if any."""
    pairs = _EXACT.findall(text)
    first = next((line.strip() for line in text.splitlines() if FIRST_MISMATCH in line), None)
    return {
        "exact_checked": int(pairs[-1][0]) if pairs else None,
        "exact_mismatch": int(pairs[-1][1]) if pairs else None,
        "exact_first_mismatch": first[first.index(FIRST_MISMATCH):][:500] if first else None,
    }


def decode_only(text: str) -> dict:
    """Steady-state decode rate from the server's own log: decode log lines
    whose interval saw no prefill (the line before is a decode line too),
    at the highest running count such lines reach; the median of their
    ``gen throughput``."""
    lines = [m for m in (re.search(r"(Prefill batch|Decode batch).*", ln)
                         for ln in text.splitlines()) if m]
    pure = []
    for prev, cur in zip(lines, lines[1:]):
        d = _DECODE.search(cur.group(0))
        if prev.group(1) == "Decode batch" and d:
            pure.append((int(d.group(1)), float(d.group(2))))
    if not pure:
        return {"decode_only_tok_s": None, "decode_only_running": None, "decode_only_lines": 0}
    top = max(r for r, _ in pure)
    rates = [g for r, g in pure if r == top]
    return {"decode_only_tok_s": statistics.median(rates), "decode_only_running": top,
            "decode_only_lines": len(rates)}


# 0.5.13 logs this traceback at every server start when openai_harmony is
# missing (entrypoints/http_server.py lifespan): benign, not a fault.
_BENIGN_TRACEBACK = "Can not initialize OpenAIServingResponses, error: Traceback"


def prefill_rate(text: str) -> Optional[float]:
    """The server's prefill speed in prompt tokens/s: the median ``input
    throughput`` of its prefill lines of at least PREFILL_RATE_MIN_TOKENS
    tokens. The first line of a burst measures the time since the last
    prefill, which decode steps (or, on a cold machine, kernel builds) fill;
    the median leaves those few out. None: no such line."""
    rates = [float(r) for n, r in _PREFILL.findall(text) if int(n) >= PREFILL_RATE_MIN_TOKENS]
    return statistics.median(rates) if rates else None


def count_tracebacks(text: str) -> dict:
    """Tracebacks in a log: those of 0.5.13's benign start-up line, and the rest."""
    benign = text.count(_BENIGN_TRACEBACK)
    return {"benign": benign, "other": text.count("Traceback") - benign}


_LONG_GC = re.compile(r"LONG GARBAGE COLLECTION DETECTED \| Generation \d+ \| Duration: (\d+\.?\d*)s")


def log_stats(log_path: Path, since: int) -> dict:
    text = log_path.read_text(errors="ignore")[since:]
    running = [int(x) for x in _RUNNING.findall(text)]
    # Server-side decode step time: each decode log line reports tokens/s
    # over its interval, i.e. running requests / step time.
    steps = [int(r) * 1000.0 / float(g) for r, g in _DECODE.findall(text) if float(g) > 0]
    # Cumulative HiSparse counters from our decode log fragment (ours only).
    misses = [int(x) for x in re.findall(r"#hisparse miss: (\d+)", text)]
    hit_rate = re.findall(r"hisparse hit rate: ([\d.]+)", text)
    read_mib = re.findall(r"host read: ([\d.]+) MiB", text)
    # ours' join wait (prefill end to joining the batch), over the launch so far
    join_wait = re.findall(r"join wait mean/max: ([\d.]+)/([\d.]+) ms", text)
    long_gc = [float(x) for x in _LONG_GC.findall(text)]
    return {
        "max_running": max(running) if running else None,
        "mean_running": statistics.mean(running) if running else None,
        "decode_step_ms": statistics.median(steps) if steps else None,
        "prefill_tok_s": prefill_rate(text),
        "hisparse_misses": misses[-1] if misses else None,
        "hisparse_hit_rate": float(hit_rate[-1]) if hit_rate else None,
        "hisparse_host_read_mib": float(read_mib[-1]) if read_mib else None,
        "join_wait_mean_ms": float(join_wait[-1][0]) if join_wait else None,
        "join_wait_max_ms": float(join_wait[-1][1]) if join_wait else None,
        # the tokenizer manager's collections over --gc-warning-threshold-secs:
        # its streams stand still meanwhile, the scheduler does not
        "long_gc": len(long_gc),
        "long_gc_max_s": max(long_gc, default=None),
        # requests SGLang retracted for want of KV space (each prefills again)
        "retracted_reqs": sum(int(x) for x in _RETRACTED.findall(text)),
        # tracebacks other than 0.5.13's benign start-up one (0: none). A bare
        # "Traceback" test read every kit launch as crashed.
        "tracebacks": count_tracebacks(text)["other"],
        # what the coordinator logged at start-up (None: not an IndexShare model)
        "indexshare_prefetch": (True if "IndexShare prefetch on" in text else
                                False if "IndexShare prefetch off" in text else None),
        **decode_only(text),
        **exact_counters(text),
    }


def check_verdict(config: str, stats: dict) -> dict:
    """What --check found in one launch of ``config`` (its log_stats from
    the start of the log) against what that configuration must show."""
    expect = CHECK_EXPECT.get(config)
    checked, bad = stats.get("exact_checked"), stats.get("exact_mismatch")
    first = stats.get("exact_first_mismatch") is not None
    if expect is None:
        verdict, ok = "n/a", None  # not this work tree's data plane
    elif not checked:
        verdict, ok = "NOT CHECKED", False  # the server printed no counters, or 0
    elif expect == "exact" and stats.get("tracebacks"):
        # counters of a server that raised cannot vouch for the rows it skipped
        verdict, ok = "TRACEBACK", False
    elif expect == "exact":
        ok = not bad and not first
        verdict = "exact" if ok else "MISMATCH"
    else:
        ok = bool(bad) or first
        verdict = "caught" if ok else "MISSED"
    return {"expect": expect, "verdict": verdict, "check_ok": ok,
            "host_misses_seen": bool(stats.get("hisparse_misses"))}


def summarize_checks(launches: list[dict]) -> list[dict]:
    """Print and return one row per launch run with --check."""
    rows = [x for x in launches if x.get("check")]
    if not rows:
        return []
    print("\nexactness check (SGLANG_HISPARSE_CHECK=1; cumulative per launch, one decode log "
          "interval behind)")
    print(f"{'config':<7} {'rep':>3}  {'workloads':<18} {'checked':>10} {'mismatch':>9}  "
          f"{'first-mismatch line':<19} {'#hisparse miss':>14}  verdict")
    for x in rows:
        v = x.get("verdict") or "n/a"
        note = "" if x.get("host_misses_seen") or x.get("expect") is None else \
            " (no host misses: host reads untested)"
        print(f"{x['config']:<7} {x['rep']:>3}  {','.join(x['workloads']):<18} "
              f"{x.get('exact_checked') if x.get('exact_checked') is not None else '-':>10} "
              f"{x.get('exact_mismatch') if x.get('exact_mismatch') is not None else '-':>9}  "
              f"{'yes' if x.get('exact_first_mismatch') else 'no':<19} "
              f"{x.get('hisparse_misses') if x.get('hisparse_misses') is not None else '-':>14}  "
              f"{v}{note}", flush=True)
        if x.get("exact_first_mismatch"):
            print(f"        {x['exact_first_mismatch'][:300]}", flush=True)
    return rows


# Below the indexer's top-k every position is selected, so nothing but the
# data plane can make two servers differ there: such requests must come out
# identical. 2048 tokens: the DSA models' index_topk (DeepSeek-V4's 512 C4
# rows span as many).
SHORT_TOKENS = 2048


def compare(base: dict, other: dict, margin: float, tol: float) -> dict:
    """Per-step logprob agreement on confident steps of the common prefix,
    and how many requests came out identical (all, and those whose prompt
    and output fit in SHORT_TOKENS)."""
    checked = bad = 0
    worst = 0.0
    requests = identical = short = short_identical = 0
    for a, b in zip(base["requests"], other["requests"]):
        ia, ib = a["output_ids"] or [], b["output_ids"] or []
        requests += 1
        identical += ia == ib
        if a.get("prompt_len", SHORT_TOKENS) + len(ia) <= SHORT_TOKENS:
            short += 1
            short_identical += ia == ib
        for s, (ta, tb) in enumerate(zip(ia, ib)):
            top2 = a["top2"][s] if s < len(a["top2"]) else []
            confident = len(top2) == 2 and top2[0] - top2[1] > margin
            if ta != tb:
                if confident:
                    bad += 1  # a real disagreement, not a near tie flipping
                break
            if not confident:
                continue
            d = abs(a["logprobs"][s] - b["logprobs"][s])
            worst = max(worst, d)
            checked += 1
            bad += d > tol
    return {"checked_steps": checked, "violations": bad, "max_abs_dlogprob": worst,
            "requests": requests, "identical": identical, "short_requests": short,
            "short_identical": short_identical}


def compare_runs(ref_runs: list, runs: list, margin: float, tol: float) -> dict:
    """``compare`` over paired runs, summed (the worst step: the largest)."""
    cmp = [compare(b, o, margin, tol) for b, o in zip(ref_runs, runs)]
    out = {k: sum(x[k] for x in cmp) for k in ("checked_steps", "violations", "requests",
                                                "identical", "short_requests", "short_identical")}
    out["max_abs_dlogprob"] = max((x["max_abs_dlogprob"] for x in cmp), default=None)
    return out


def describe_exactness(ex: dict, tol: float) -> str:
    return (f"{ex['checked_steps']} steps, {ex['violations']} over {tol}, max "
            f"{ex['max_abs_dlogprob']}; identical {ex['identical']}/{ex['requests']} (short "
            f"{ex['short_identical']}/{ex['short_requests']})")


def build_parser() -> argparse.ArgumentParser:
    """The command line (its own function: the tests parse flags with it)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("TINY_DSV32", ".gpu/tiny-dsv32"))
    ap.add_argument("--configs", default="base,ours")
    ap.add_argument("--workloads", default="smoke")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of launches; each round launches every configuration in turn")
    ap.add_argument("--inner-repeats", type=int, default=1,
                    help="runs of each workload per launch (launches cost ~1 min each)")
    ap.add_argument("--warmup", type=int, choices=(0, 1, 2), default=1,
                    help="after every launch, unrecorded: 1 runs each workload once (default); "
                         "2 sends each workload's longest prompt once for 2 tokens (the first "
                         "full-size prefill builds its kernels: see warm_up); 0 nothing")
    ap.add_argument("--freeze-gc", action="store_true",
                    help="after the warm-up, POST /freeze_gc to every server (SGLang's advice "
                         "against its collections' latency jitter; every configuration alike)")
    ap.add_argument("--port", type=int, default=30010)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e.json"))
    ap.add_argument("--logs", default=os.environ.get("OUT", "."))
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="launch nothing: summarize the runs of earlier e2e JSON files together")
    ap.add_argument("--step-timer", action="store_true",
                    help="time the scheduler's per-step functions in every server "
                         "(scripts/steptimer) and print them per workload and config")
    ap.add_argument("--step-profile", action="store_true",
                    help="with --step-timer: also cProfile each scheduler thread (LOGS/steptimer_*/"
                         "profile_*.prof; compare two with scripts/steptimer/hisparse_steptimer.py "
                         "A B); slows the servers, so its timings are not figures")
    ap.add_argument("--cpu-probe", action="store_true",
                    help="first time a Python loop on every core and print the spread (see Noise above)")
    ap.add_argument("--cpus", default="",
                    help="run every server on these cores: '0,2,8,9' or 'fastest:N' (implies --cpu-probe)")
    ap.add_argument("--baseline-json", default=None,
                    help="take the base runs from an earlier e2e JSON instead of launching base")
    ap.add_argument("--ref-pkg", default=None, metavar="DIR",
                    help="configuration 'ref': the package installed at DIR (pip install --no-deps "
                         "--target DIR) instead of this work tree's, e.g. an earlier commit")
    ap.add_argument("--check", action="store_true",
                    help=f"{CHECK_ENV}=1 in every HiSparse server; tabulate its counters per launch "
                         "(exit 1 unless ours/nopark are exact and noio shows mismatches)")
    ap.add_argument("--hisparse-config", default=None, metavar="JSON",
                    help=f"--hisparse-config for the HiSparse servers (default {json.dumps(HS_CONFIG)}; "
                         f"DeepSeek-V4: {json.dumps(ARCH_HS_CONFIG['dsv4'])})")
    ap.add_argument("--synthetic", default=None, metavar="SPEC",
                    help=f"{SYNTHETIC_ENV}=SPEC in {'/'.join(SYNTHETIC_CONFIGS)} (e.g. 'calibrated'): a "
                         "benchmark-only top-k of known locality in place of the indexer's; "
                         "outputs invalid, so no logprob comparison is made for them")
    ap.add_argument("--geometry", default=None, choices=("tiny", "v32"),
                    help="instead of --model: write scripts/model_config.py's geometry (with "
                         "--layers) into LOGS/model and serve that")
    ap.add_argument("--layers", type=int, default=None, help="with --geometry: the layer count")
    ap.add_argument("--index-pattern", default=None, metavar="FS...|glm52",
                    help="serve the model with IndexShare layers: index_topk_pattern written "
                         "into a copy of its config (scripts/model_config.py --index-pattern)")
    ap.add_argument("--requests", type=int, default=None, metavar="N",
                    help="send at most N prompts of each group (the decode-only figure needs "
                         "only enough to reach a configuration's highest running count)")
    ap.add_argument("--max-new", type=int, default=None, metavar="N",
                    help="output tokens per request instead of the workload's")
    ap.add_argument("--mtp", default=None, metavar="STEPS,TOPK,NDT",
                    help="every server runs MTP (EAGLE) with these --speculative-num-steps, "
                         "--speculative-eagle-topk and --speculative-num-draft-tokens, e.g. 1,1,2 "
                         "or 3,1,4; a model without a NextN layer gets one "
                         "(num_nextn_predict_layers 1, random weights)")
    ap.add_argument("--server-args", default="",
                    help="extra sglang.launch_server flags for every launch, one shell-quoted "
                         "string (after the workload's own; the last of a repeated flag wins)")
    ap.add_argument("--parallel", action="store_true",
                    help="launch every configuration of a launch at once, each on its own port "
                         f"(--port + {PARALLEL_PORT_STRIDE} x its place in --configs; "
                         f"--mem-fraction-static {PARALLEL_MEM_FRACTION} unless --server-args sets "
                         "it): outputs, the check, parity and the drain in one launch's time; the "
                         "servers share the GPU and the cores, so their timings are not figures")
    ap.add_argument("--together", action="store_true",
                    help="start every configuration's server at once (ports as --parallel), then "
                         "run the workloads on one server at a time, the configurations taking "
                         "turns (the order reversed every other --inner-repeats round); with "
                         "--cpus the server whose turn it is runs on those cores and the idle "
                         "ones on the others. Timings are figures: one launch's start-up for "
                         "all, and interleaved runs instead of one launch after the other")
    ap.add_argument("--dry-run", action="store_true",
                    help="launch nothing: print each launch's sglang.launch_server command and the "
                         "environment it adds (the model's architecture decides the flags), then exit")
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    args.step_timer = args.step_timer or args.step_profile
    if args.together and args.parallel:
        ap.error("--together and --parallel exclude each other (--parallel runs the "
                 "configurations' workloads at once, --together one at a time)")
    if args.merge:
        return merge(args)
    configs = args.configs.split(",")
    workloads = args.workloads.split(",")
    bad = [c for c in configs if c not in CONFIGS] + [w for w in workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown configuration or workload {bad}; configurations: {', '.join(CONFIGS)}; "
                 f"workloads: {', '.join(WORKLOADS)}")
    if "ref" in configs:
        if not args.ref_pkg:
            ap.error("--configs ref needs --ref-pkg DIR")
        try:
            args.ref_pkg = check_ref_pkg(args.ref_pkg)
        except ValueError as exc:
            ap.error(str(exc))
    hs_config = json.loads(args.hisparse_config) if args.hisparse_config else None
    import shlex

    opts = {"hs_config": hs_config, "ref_pkg": args.ref_pkg, "check": args.check,
            "server_args": shlex.split(args.server_args), "synthetic": args.synthetic}
    if (args.parallel or args.together) and "--mem-fraction-static" not in opts["server_args"]:
        opts["server_args"] += ["--mem-fraction-static", PARALLEL_MEM_FRACTION]
    if args.geometry:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import model_config

        args.model = str(model_config.write(
            model_config.build_config(args.geometry, args.layers, args.index_pattern),
            Path(args.logs) / "model").parent)
    elif args.index_pattern:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import model_config

        cfg = json.loads((Path(args.model) / "config.json").read_text())
        try:
            cfg["index_topk_pattern"] = model_config.index_pattern(
                args.index_pattern, cfg["num_hidden_layers"])
        except ValueError as exc:
            ap.error(str(exc))
        args.model = str(model_config.write(cfg, Path(args.logs) / "model-indexshare").parent)
    if args.index_pattern:
        served = json.loads((Path(args.model) / "config.json").read_text())
        print(f"index_topk_pattern {served['index_topk_pattern']}", flush=True)
    if args.mtp:
        try:
            args.model, spec_flags = mtp_model_and_flags(args.model, Path(args.logs), args.mtp)
        except ValueError as exc:
            ap.error(str(exc))
        opts["spec_flags"] = spec_flags
    # A config directory given relative to here must still be found from the
    # servers' own (empty) working directory.
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    by_flags = launch_groups(workloads, model_arch(model))
    if args.dry_run:
        return dry_run(model, args.port, configs, by_flags, opts)
    exit_on_sigterm()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    env: dict = {}
    if args.cpu_probe or args.cpus.startswith("fastest:"):
        env["cpu_core_s"] = cpu_core_speeds()
        print(describe_core_speeds(env["cpu_core_s"]), flush=True)
    cpus = choose_cpus(args.cpus, env.get("cpu_core_s", {})) if args.cpus else None
    if cpus:
        env["cpus"] = sorted(cpus)
        print(f"servers run on cores {sorted(cpus)}", flush=True)
    env["model"] = model
    env["synthetic"] = args.synthetic
    env["package"] = {}
    for cfg in configs:
        _, senv = server_cmd(model, args.port, cfg, [], **opts)
        env["package"][cfg] = package_origin(senv)
        print(f"[{cfg}] sglang_hisparse from {env['package'][cfg]}", flush=True)
    if "ref" in configs and not str(env["package"]["ref"].get("origin", "")).startswith(args.ref_pkg):
        print(f"--ref-pkg {args.ref_pkg} is not what the ref server would import", flush=True)
        return 2
    results: dict = {c: {w: [] for w in workloads} for c in configs}
    launches: list[dict] = []

    def save_partial(current: Optional[dict] = None) -> None:
        """The runs so far as a partial JSON (--merge reads it), with
        ``current``: the runs of a launch still serving."""
        runs = {c: {w: results[c][w] + (current or {}).get(c, {}).get(w, []) for w in workloads}
                for c in configs}
        Path(args.out).write_text(json.dumps({"partial": True, "env": env, "runs": runs,
                                              "launches": launches}, indent=1))

    def launch(cfg: str, port: int, rep: int, flags, wenv, ws) -> tuple[dict, dict]:
        return serve_launch(model, port, cfg, rep, list(flags), dict(wenv), ws, args, opts, cpus)

    for rep in range(args.repeats):
        for (flags, wenv), ws in by_flags.items():
            if args.together:
                # Every run is inside one launch: written as it ends, so
                # that a cut-off command leaves the runs made so far.
                together = serve_together(model, configs, args.port, rep, flags, wenv, ws, args,
                                          opts, cpus, checkpoint=save_partial)
                launched = [together[cfg] for cfg in configs]
            elif args.parallel:
                # Every configuration at once, each on its own port.
                with ThreadPoolExecutor(len(configs)) as ex:
                    futs = [ex.submit(launch, cfg, args.port + PARALLEL_PORT_STRIDE * i, rep, flags,
                                      wenv, ws) for i, cfg in enumerate(configs)]
                    launched = [f.result() for f in futs]
            else:  # one after the other, each launched when the one before has stopped
                launched = (launch(cfg, args.port, rep, flags, wenv, ws) for cfg in configs)
            for cfg, (runs, record) in zip(configs, launched):
                for w in ws:
                    results[cfg][w].extend(runs[w])
                launches.append(record)
                # What is done so far survives a later launch being cut off.
                save_partial()
    if args.baseline_json and "base" not in configs:
        earlier = json.loads(Path(args.baseline_json).read_text())["runs"]["base"]
        results["base"] = {w: earlier.get(w, []) for w in workloads}
        configs = ["base"] + configs
    summary = summarize(results, configs, workloads, args.margin, args.tol,
                        not_the_models_outputs(args.synthetic))
    decode = summarize_decode(results, configs, workloads)
    indexshare = summarize_indexshare(summary, decode)
    if args.step_timer:
        print_step_timer(results, configs, workloads)
    checks = summarize_checks(launches)
    spec = summarize_spec(results, configs, workloads) if args.mtp else []
    spec += summarize_mtp_targets(summary) if args.mtp else []
    realistic = summarize_realistic_targets(summary, decode, args.synthetic)
    drain = summarize_drain(results, configs)
    Path(args.out).write_text(json.dumps({"summary": summary, "decode": decode, "env": env,
                                          "indexshare": indexshare, "runs": results,
                                          "launches": launches, "checks": checks,
                                          "spec": spec, "realistic": realistic,
                                          "drain": drain}, indent=1))
    failed_checks = [c for c in checks if c.get("check_ok") is False]
    failed_drain = [d for d in drain if not d["ok"]]
    return 1 if failed_checks or failed_drain or not all(s.get("ok", True) for s in summary) else 0


def serve_launch(model: str, port: int, cfg: str, rep: int, flags: list, wenv: dict, ws: list,
                 args, opts: dict, cpus) -> tuple[dict, dict]:
    """One launch of ``cfg`` serving the workloads ``ws`` (``args.inner_repeats``
    runs each, after a warm-up run unless ``--warmup 0``); returns its runs
    per workload and the launch's record. A launch that fails gets runs
    holding the error, so every configuration has as many runs as the others."""
    log, timer_out = launch_files(args, cfg, ws, rep)
    if args.parallel:
        # SGLang picks a free port for torch.distributed's store at start-up;
        # servers starting together can pick the same one (2026-12-04-s3:
        # EADDRINUSE), so each gets its own next to its HTTP port.
        flags = list(flags) + ["--nccl-port", str(port + 1)]
    srv = Server(model, port, cfg, list(flags), log, timer_out, cpus,
                 step_profile=args.step_profile, extra_env=dict(wenv), **opts)
    record = {"config": cfg, "rep": rep, "workloads": ws, "log": log.name, "check": args.check,
              "port": port}
    runs: dict = {w: [] for w in ws}
    try:
        ready = srv.wait_ready()
        record["ready_s"] = ready
        print(f"[{cfg} rep{rep}] ready in {ready:.0f}s", flush=True)
        warm_up(srv.url, ws, args, log)
        after_warm_up(srv.url, cfg, rep, args, record)
        if args.step_profile and timer_out is not None:
            # The profile restarts at the first batch after this.
            (timer_out / "profile_reset").touch()
        for inner, w in [(i, w) for i in range(args.inner_repeats) for w in ws]:
            runs[w].append(measured_run(srv, cfg, f"rep{rep}.{inner}", w, args, log, timer_out))
        if args.check:
            flush_counters(srv.url)
    except Exception as exc:
        record["error"] = repr(exc)
        print(f"[{cfg} rep{rep}] FAILED: {exc!r}", flush=True)
        pad_failed_runs(runs, args.inner_repeats, repr(exc), log_stats(log, 0))
    finally:
        stop_launch(srv, log, record, args)
    return runs, record


def warm_up(url: str, ws: list, args, log: Path) -> None:
    """The unrecorded run after a launch (``--warmup``). The first batch
    after launch pays one-time costs (JIT builds, allocator growth).
    ``--warmup 1`` runs each workload once; ``--warmup 2`` only prefills
    each workload's longest prompt (two tokens: one decode step), which
    builds the kernels of the full-size chunks at the cost of one prefill.
    Without it the configuration measured first on a cold machine pays the
    builds alone: ours' first 8192-token chunk waited 17 s, a third of its
    decodelong run (1835 tok/s; the same server's prefills then took 10 s
    for 16 prompts; 2026-12-07-s3)."""
    for w in [w for w in ws if w != "drain"]:
        if args.warmup == 2:
            longest = max(n for group in WORKLOADS[w][0] for n in group)
            run_workload(url, w, seed0=7919, max_new=2, log_path=log, prompts=[[longest]])
        elif args.warmup:
            run_workload(url, w, seed0=7919, max_requests=args.requests,
                         max_new=args.max_new, log_path=log)


# SGLang's own advice for its latency jitter: a full collection in the
# tokenizer manager stops every stream while the scheduler decodes on, and
# SGLang logs it (--gc-warning-threshold-secs) with "Consider calling the
# freeze_gc API after sending a few warmup requests". 2026-12-07-s11: the
# only hold run over the gap target (206 x its median) had one, 0.724 s of
# generation 2 over 1,167,241 objects; its two runs without one gave 4.9 x
# and 5.6 x. The endpoint freezes the scheduler's objects too.
FREEZE_GC_PATH = "/freeze_gc"


def post_json(url: str, body: dict, timeout: float = 600) -> str:
    """One JSON POST to a server endpoint; its answer as text."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def freeze_gc(url: str) -> None:
    """POST ``/freeze_gc`` (``--freeze-gc``, after the warm-up): the
    objects the server holds then move to Python's permanent generation,
    which no later collection walks."""
    post_json(url + FREEZE_GC_PATH, {})


def after_warm_up(url: str, cfg: str, rep: int, args, record: dict) -> None:
    """What a launch does once warm, before its measured runs: under
    ``--freeze-gc`` freezes the server's garbage collector (every
    configuration alike, so the comparison stays side by side)."""
    if args.freeze_gc:
        freeze_gc(url)
        record["gc_frozen"] = True
        print(f"[{cfg} rep{rep}] gc frozen", flush=True)


def launch_files(args, cfg: str, ws: list, rep: int) -> tuple[Path, Path | None]:
    """A launch's server log, and its step-timer folder under --step-timer."""
    log = Path(args.logs) / f"server_{cfg}_{ws[0]}_{rep}.log"
    timer_out = (Path(args.logs) / f"steptimer_{cfg}_{ws[0]}_{rep}" if args.step_timer else None)
    return log, timer_out


def pad_failed_runs(runs: dict, repeats: int, error: str, stats: dict) -> None:
    """A failed launch still has ``repeats`` runs per workload, holding the
    error, so every configuration has as many runs as the others."""
    for w_runs in runs.values():
        w_runs.extend({"requests": [], "errors": [error], **stats}
                      for _ in range(max(0, repeats - len(w_runs))))


def stop_launch(srv, log: Path, record: dict, args) -> None:
    """Stop a launch's server; its record gets the whole log's figures and,
    under --check, the check's verdict."""
    srv.stop()
    record.update(log_stats(log, 0))
    if args.check:
        record.update(check_verdict(record["config"], record))


def measured_run(srv, cfg: str, label: str, w: str, args, log: Path, timer_out) -> dict:
    """One recorded run of workload ``w`` on a ready server: its requests'
    figures and what the server logged meanwhile."""
    mark = log.stat().st_size
    time.sleep(0.6 if timer_out else 0)  # let the snapshot catch up
    before = step_timer_snapshot(timer_out)
    r = (run_drain(srv.url, log, max_new=args.max_new) if w == "drain"
         else run_workload(srv.url, w, max_requests=args.requests,
                           max_new=args.max_new, log_path=log))
    r.update(log_stats(log, mark))
    if timer_out:
        time.sleep(0.6)
        r["step_timer"] = step_timer_diff(before, step_timer_snapshot(timer_out))
    print(f"[{cfg} {label}] {w}: {len(r['requests'])} ok, "
          f"{len(r['errors'])} errors, {r['output_tok_s']:.0f} tok/s, "
          f"tpot {r['mean_tpot_ms']}, ttft {r['median_ttft_s']} s, "
          f"step {r['decode_step_ms']} ms, running max {r['max_running']}, "
          f"retracted {r['retracted_reqs']}, "
          f"hisparse misses {r['hisparse_misses']} (hit rate "
          f"{r['hisparse_hit_rate']}, host read {r['hisparse_host_read_mib']} MiB)"
          + (f", exact checked {r['exact_checked']} mismatch {r['exact_mismatch']}"
             if args.check else "")
          + (f", long GC {r['long_gc']} (max {r['long_gc_max_s']:.2f} s)" if r.get("long_gc") else ""),
          flush=True)
    return r


def group_threads(pgid: int) -> list[int]:
    """Every thread of every process in process group ``pgid`` (a server
    and what it started: scheduler, detokenizer, their threads)."""
    tids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            # the fields after the command name (which may hold spaces): state ppid pgrp ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            tids += [int(t) for t in os.listdir(f"/proc/{entry}/task")]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return tids


def move_server(srv, cpus) -> None:
    """Put every thread of a running server on ``cpus``. SGLang's scheduler
    polls in a loop while idle (a core each without --sleep-on-idle), so with
    --together the idle servers go to the cores the measured one does not use."""
    for tid in group_threads(srv.proc.pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # exited meanwhile


def serve_together(model: str, configs: list[str], port: int, rep: int, flags: list, wenv: dict,
                   ws: list, args, opts: dict, cpus, checkpoint=None) -> dict:
    """--together: every configuration's server started at once, then each
    workload run on one server at a time; configurations take turns, in
    ``configs`` order on even inner rounds and reversed on odd ones, so no
    configuration always runs first. With ``cpus`` the server whose turn it
    is runs there and the others on the remaining cores. Returns per config
    what serve_launch returns."""
    everyone = os.sched_getaffinity(0)
    idle_cpus = ((everyone - set(cpus)) or everyone) if cpus else None
    servers: dict = {}
    files = {cfg: launch_files(args, cfg, ws, rep) for cfg in configs}
    logs = {cfg: files[cfg][0] for cfg in configs}
    records = {cfg: {"config": cfg, "rep": rep, "workloads": ws, "log": logs[cfg].name,
                     "check": args.check, "port": port + PARALLEL_PORT_STRIDE * i,
                     "together": list(configs)} for i, cfg in enumerate(configs)}
    runs: dict = {cfg: {w: [] for w in ws} for cfg in configs}
    try:
        for cfg in configs:
            p, (log, timer_out) = records[cfg]["port"], files[cfg]
            servers[cfg] = (Server(model, p, cfg, list(flags) + ["--nccl-port", str(p + 1)], log,
                                   timer_out, None, step_profile=args.step_profile,
                                   extra_env=dict(wenv), **opts), log, timer_out)
        for cfg, (srv, _, _) in servers.items():
            try:
                records[cfg]["ready_s"] = srv.wait_ready()
                print(f"[{cfg} rep{rep}] ready in {records[cfg]['ready_s']:.0f}s", flush=True)
            except Exception as exc:
                records[cfg]["error"] = repr(exc)
                print(f"[{cfg} rep{rep}] FAILED: {exc!r}", flush=True)
        ready = [c for c in configs if c in servers and "error" not in records[c]]

        def turn(cfg: str) -> None:
            if cpus:
                for other in ready:
                    move_server(servers[other][0], cpus if other == cfg else idle_cpus)

        for cfg in ready if args.warmup else []:
            turn(cfg)
            warm_up(servers[cfg][0].url, ws, args, servers[cfg][1])
        for cfg in ready:
            after_warm_up(servers[cfg][0].url, cfg, rep, args, records[cfg])
        for inner in range(args.inner_repeats):
            for cfg in (ready if inner % 2 == 0 else ready[::-1]):
                srv, log, timer_out = servers[cfg]
                turn(cfg)
                for w in ws:
                    try:
                        runs[cfg][w].append(measured_run(srv, cfg, f"rep{rep}.{inner}", w, args,
                                                         log, timer_out))
                    except Exception as exc:
                        records[cfg]["error"] = repr(exc)
                        print(f"[{cfg} rep{rep}.{inner}] {w} FAILED: {exc!r}", flush=True)
                    if checkpoint:
                        checkpoint(runs)
        for cfg in ready if args.check else []:
            flush_counters(servers[cfg][0].url)
    finally:
        for srv, _, _ in servers.values():  # all at once: each may take seconds to exit
            srv.terminate()
        for cfg, (srv, log, _) in servers.items():
            stop_launch(srv, log, records[cfg], args)
    for cfg in configs:
        pad_failed_runs(runs[cfg], args.inner_repeats, records[cfg].get("error", "no run"),
                        log_stats(logs[cfg], 0) if logs[cfg].exists() else {})
    return {cfg: (runs[cfg], records[cfg]) for cfg in configs}


def launch_groups(workloads: list[str], arch: str = "dsa") -> dict[tuple, list[str]]:
    """Workloads with their own server flags (or environment) get their own
    launches: (flags, environment items) -> the workloads one launch serves."""
    by_flags: dict[tuple, list[str]] = {}
    for w in workloads:
        flags = WORKLOADS[w][2] + ARCH_WORKLOAD_FLAGS.get(arch, {}).get(w, [])
        key = (tuple(flags), tuple(sorted(WORKLOAD_ENV.get(w, {}).items())))
        by_flags.setdefault(key, []).append(w)
    return by_flags


def dry_run(model: str, port: int, configs: list[str], by_flags: dict, opts: dict) -> int:
    """--dry-run: one line per launch (in the order a round makes them) with
    the environment it adds to this one and its command line."""
    import shlex

    print(f"model {model} (architecture {model_arch(model)})", flush=True)
    for (flags, wenv), ws in by_flags.items():
        for cfg in configs:
            cmd, env = server_cmd(model, port, cfg, list(flags), extra_env=dict(wenv), **opts)
            added = {k: v for k, v in env.items() if os.environ.get(k) != v}
            print(f"[{cfg} {','.join(ws)}] "
                  + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(added.items()))
                  + (" " if added else "") + shlex.join(cmd), flush=True)
    return 0


def print_step_timer(results, configs, workloads) -> None:
    """Per workload: each timed function's wall time per scheduled batch
    (median over runs), one column per configuration."""
    for w in workloads:
        per_cfg = {}
        for c in configs:
            runs = [r["step_timer"] for r in results.get(c, {}).get(w, []) if r.get("step_timer")]
            if not runs:
                continue
            names = {n for r in runs for n in r}
            per_cfg[c] = {}
            for n in names:
                vals = [r[n][0] * 1e6 / max(r.get("Scheduler.run_batch", [0, 1])[1], 1)
                        for r in runs if n in r]
                per_cfg[c][n] = statistics.median(vals)
            per_cfg[c]["(batches)"] = statistics.median(
                r.get("Scheduler.run_batch", [0, 0])[1] for r in runs)
        if not per_cfg:
            continue
        cols = list(per_cfg)
        print(f"\nstep timer, {w}: us per scheduled batch (inclusive; median over runs)")
        print(f"{'function':48s}" + "".join(f"{c:>12s}" for c in cols))
        names = sorted({n for d in per_cfg.values() for n in d},
                       key=lambda n: -max(d.get(n, 0) for d in per_cfg.values()))
        for n in names:
            print(f"{n:48s}" + "".join(f"{per_cfg[c].get(n, float('nan')):12.1f}" for c in cols))


def merge(args) -> int:
    """Concatenate the runs of several e2e JSON files (e.g. two rounds of
    launches made by separate commands) and summarize them as one."""
    results: dict = {}
    launches: list = []
    synthetic = set()
    for path in args.merge:
        data = json.loads(Path(path).read_text())
        synthetic.add(data.get("env", {}).get("synthetic"))
        for cfg, by_w in data["runs"].items():
            for w, runs in by_w.items():
                for run in runs:  # gap statistics added since the run: from its requests
                    for k, v in gap_stats(run.get("requests") or []).items():
                        run.setdefault(k, v)
                results.setdefault(cfg, {}).setdefault(w, []).extend(runs)
        launches += [dict(x, source=str(path)) for x in data.get("launches", [])]
    configs = [c for c in CONFIGS if c in results] + [c for c in results if c not in SERVER_CONFIGS]
    workloads = sorted({w for by_w in results.values() for w in by_w})
    for c in configs:
        for w in workloads:
            results[c].setdefault(w, [])
    summary = summarize(results, configs, workloads, args.margin, args.tol,
                        not_the_models_outputs(any(synthetic)))
    decode = summarize_decode(results, configs, workloads)
    indexshare = summarize_indexshare(summary, decode)
    checks = summarize_checks(launches)
    # The MTP targets only for speculative runs (their requests carry accept lengths).
    speculative = any(q.get("spec_accept_length") is not None for by_w in results.values()
                      for runs in by_w.values() for r in runs for q in r["requests"])
    spec = summarize_spec(results, configs, workloads) + (
        summarize_mtp_targets(summary) if speculative else [])
    # Rounds of one top-k only: the skip-IO target depends on it.
    realistic = summarize_realistic_targets(
        summary, decode, synthetic.pop()) if len(synthetic) == 1 else []
    drain = summarize_drain(results, configs)
    Path(args.out).write_text(json.dumps({"summary": summary, "decode": decode, "runs": results,
                                          "indexshare": indexshare, "launches": launches,
                                          "checks": checks, "spec": spec,
                                          "realistic": realistic, "drain": drain},
                                         indent=1))
    return 0


def _med(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.median(xs), (max(xs) - min(xs)) / 2


def workload_limit(base_runs: list, out_tokens: int) -> Optional[dict]:
    """Estimate the best output rate any scheduler could reach on a workload,
    from base's own runs: the GPU prefills the prompts one after another, and
    the request prefilled last still decodes its other tokens one step at a
    time, each at least base's median decode step. Decoding that overlaps
    prefill counts as free, so n x prefill + (tokens - 1) x step bounds the
    wall time from below. A prompt's prefill is its length over the server's
    prefill rate (``prefill_tok_s``, from its log) where the runs have one,
    else the first request's time to first token (the one prefill that ran
    alone). The TTFT alone misled on a cold machine: base's first request
    built the kernels (10.3 s against 0.6 s warm, 2026-12-06-s5), and the
    limit came out below base's own rate."""
    runs = [r for r in base_runs if r.get("requests")]
    step_ms, _ = _med([r.get("decode_step_ms") for r in base_runs])
    n = max((len(r["requests"]) for r in runs), default=0)
    rate, _ = _med([r.get("prefill_tok_s") for r in runs])
    prompt, _ = _med([q.get("prompt_len") for r in runs for q in r["requests"]])
    if rate and prompt:
        prefill_s, source = prompt / rate, "server prefill rate"
    else:
        prefill_s, _ = _med([min(q["ttft"] for q in r["requests"]) for r in runs])
        source = "first TTFT"
    if not prefill_s or not step_ms or not n:
        return None
    wall = n * prefill_s + (out_tokens - 1) * step_ms / 1e3
    return {"output_tok_s": n * out_tokens / wall, "prompts": n, "prefill_s": prefill_s,
            "prefill_from": source, "step_ms": step_ms, "wall_s": wall}


def summarize_decode(results, configs, workloads) -> list[dict]:
    """Per workload and configuration: the decode-only rate (the server's
    decode log at its highest running count, intervals without prefill)
    and the streaming gaps, medians over runs, with ratios to base, native
    and noio."""
    rows = []
    print("\nworkload    config  decode-only tok/s @running (x base, x native, / noio)   "
          "inter-token gap p50 / p99 ms (p99 / TPOT)   worst gap / own median   "
          "first gap p50 ms (server join wait mean/max ms)")
    for w in workloads:
        med = {c: {k: _med([r.get(k) for r in results[c][w]]) for k in
                   ("decode_only_tok_s", "decode_only_running", "itg_p50_ms", "itg_p99_ms",
                    "itg_worst_over_median", "mean_tpot_ms", "itg_first_p50_ms",
                    "join_wait_mean_ms", "join_wait_max_ms")} for c in configs}
        for c in configs:
            m = {k: v[0] for k, v in med[c].items()}
            row = {"workload": w, "config": c, **m,
                   "decode_only_tok_s_spread": med[c]["decode_only_tok_s"][1]}
            for other in ("base", "native", "noio"):
                o = med.get(other, {}).get("decode_only_tok_s", (None,))[0]
                if o and m["decode_only_tok_s"]:
                    row[f"decode_only_vs_{other}"] = m["decode_only_tok_s"] / o
            if m["itg_p99_ms"] and m["mean_tpot_ms"]:
                row["itg_p99_over_tpot"] = m["itg_p99_ms"] / m["mean_tpot_ms"]
            rows.append(row)
            f = lambda v, spec=".1f": format(v, spec) if v is not None else "-"  # noqa: E731
            print(f"{w:<11} {c:<7} {f(m['decode_only_tok_s']):>9} ± "
                  f"{f(med[c]['decode_only_tok_s'][1]):<6} @{f(m['decode_only_running'], '.0f'):<3} "
                  f"(x{f(row.get('decode_only_vs_base'), '.2f')}, "
                  f"x{f(row.get('decode_only_vs_native'), '.2f')}, "
                  f"{f(row.get('decode_only_vs_noio'), '.2f')})   "
                  f"{f(m['itg_p50_ms'], '.2f'):>7} / {f(m['itg_p99_ms'], '.2f'):<8} "
                  f"({f(row.get('itg_p99_over_tpot'), '.2f')})   "
                  f"{f(m['itg_worst_over_median'], '.1f'):>8}   "
                  f"{f(m['itg_first_p50_ms'], '.1f')} ({f(m['join_wait_mean_ms'], '.1f')}/"
                  f"{f(m['join_wait_max_ms'], '.1f')})", flush=True)
    return rows


# Issue #20's targets: the prefetch at >= 85% of skip-IO throughput, and a
# TPOT below synchronous by >= 1/3 of the synchronous - skip-IO gap.
INDEXSHARE_TARGETS = {"tok_s_vs_noio": 0.85, "tpot_gap_closed": 1 / 3,
                      "decode_only_vs_noio": 0.85, "step_gap_closed": 1 / 3}


def _rate_ratios(ours: dict, sync: dict, noio: dict, rate: str, prefix: str) -> dict:
    """ours' and sync's ``rate`` over noio's."""
    out = {}
    for name, row in ((f"{prefix}vs_noio", ours), (f"sync_{prefix}vs_noio", sync)):
        if row.get(rate) and noio.get(rate):
            out[name] = row[rate] / noio[rate]
    return out


def _gap_closed(ours: dict, sync: dict, noio: dict, time: str, prefix: str) -> dict:
    """The three ``time`` values, and the share of the sync - noio gap in it
    that ours closes."""
    t_o, t_s, t_n = ours.get(time), sync.get(time), noio.get(time)
    if not (t_o and t_s and t_n):
        return {}
    out = {f"{prefix}ms": t_o, f"sync_{prefix}ms": t_s, f"noio_{prefix}ms": t_n}
    if t_s > t_n:
        out[f"{prefix}gap_closed"] = (t_s - t_o) / (t_s - t_n)
    return out


def indexshare_ratios(ours: dict, sync: dict, noio: dict, decode: tuple = ()) -> dict:
    """ours (the prefetch) against sync and noio, from summary rows: end to
    end (out tok/s, TPOT) and, given the three decode rows, in the decode
    phase alone (decode-only tok/s, the server's decode step), where prefill
    does not dilute the host reads."""
    out = {**_rate_ratios(ours, sync, noio, "output_tok_s", "tok_s_"),
           **_gap_closed(ours, sync, noio, "tpot_ms", "tpot_")}
    if decode:
        out.update(_rate_ratios(*decode, "decode_only_tok_s", "decode_only_"))
        out.update(_gap_closed(ours, sync, noio, "decode_step_ms", "step_"))
    for key, target in INDEXSHARE_TARGETS.items():
        if key in out:
            out[f"{key}_target_met"] = out[key] >= target
    return out


def summarize_indexshare(summary: list[dict], decode: list[dict] = ()) -> list[dict]:
    """Per workload and prefetch configuration (ours; warp, its one-warp
    replay blocks) run beside sync and noio: the IndexShare prefetch's ratios
    (a second line from the decode table when given). Rows of warp are
    labelled WORKLOAD/warp."""
    by = {(r["workload"], r["config"]): r for r in summary}
    by_decode = {(r["workload"], r["config"]): r for r in decode}
    rows = []
    f = lambda v, spec=".2f": format(v, spec) if v is not None else "-"  # noqa: E731
    met = lambda row, key: "met" if row.get(f"{key}_target_met") else "NOT met"  # noqa: E731
    for w in sorted({r["workload"] for r in summary}):
        for prefetch in PREFETCH_CONFIGS:
            if not all((w, c) in by for c in (prefetch, "sync", "noio")):
                continue
            three = tuple(by_decode[(w, c)] for c in (prefetch, "sync", "noio")
                          if (w, c) in by_decode)
            row = {"workload": w, "config": prefetch,
                   **indexshare_ratios(by[(w, prefetch)], by[(w, "sync")], by[(w, "noio")],
                                       three if len(three) == 3 else ())}
            rows.append(row)
            if len(rows) == 1:
                print("\nIndexShare (ours = prefetch, sync = synchronous, noio = skip-IO; "
                      "WORKLOAD/warp: the prefetch with one-warp replay blocks): "
                      "ours/noio tok/s (target >= 0.85), sync/noio, TPOT ours/sync/noio ms, "
                      "share of the sync-noio TPOT gap closed (target >= 0.33); "
                      "indexshare-decode: the same from the decode-only rate and the server's "
                      "decode step (no prefill in them)")
            label = w if prefetch == "ours" else f"{w}/{prefetch}"
            print(f"indexshare {label:<11} {f(row.get('tok_s_vs_noio'))} "
                  f"({met(row, 'tok_s_vs_noio')})   "
                  f"{f(row.get('sync_tok_s_vs_noio'))}   {f(row.get('tpot_ms'))} / "
                  f"{f(row.get('sync_tpot_ms'))} / {f(row.get('noio_tpot_ms'))}   "
                  f"{f(row.get('tpot_gap_closed'))} ({met(row, 'tpot_gap_closed')})", flush=True)
            if "decode_only_vs_noio" in row or "step_gap_closed" in row:
                print(f"indexshare-decode {label:<11} {f(row.get('decode_only_vs_noio'))} "
                      f"({met(row, 'decode_only_vs_noio')})   "
                      f"{f(row.get('sync_decode_only_vs_noio'))}   {f(row.get('step_ms'))} / "
                      f"{f(row.get('sync_step_ms'))} / {f(row.get('noio_step_ms'))}   "
                      f"{f(row.get('step_gap_closed'))} ({met(row, 'step_gap_closed')})", flush=True)
    return rows


def summarize(results, configs, workloads, margin, tol, invalid=("noio",)) -> list[dict]:
    """``invalid``: configurations whose outputs are not the model's (skip-IO,
    a synthetic top-k): no logprob comparison."""
    rows = []
    print("\nworkload    config  runs ok/err   out tok/s (median ± half-range)   TPOT ms   "
          "step ms   running max/mean   exactness vs base")
    for w in workloads:
        base_tps = _med([r.get("output_tok_s") for r in results.get("base", {}).get(w, [])])[0]
        base_tpot = _med([r.get("mean_tpot_ms") for r in results.get("base", {}).get(w, [])])[0]
        native_tps = _med([r.get("output_tok_s") for r in results.get("native", {}).get(w, [])])[0]
        ref_tps = _med([r.get("output_tok_s") for r in results.get("ref", {}).get(w, [])])[0]
        ref_tpot = _med([r.get("mean_tpot_ms") for r in results.get("ref", {}).get(w, [])])[0]
        base_runs = results.get("base", {}).get(w, [])
        out_tokens = max((len(q["output_ids"] or []) for r in base_runs for q in r["requests"]),
                         default=WORKLOADS[w][1])  # --max-new may differ from the workload's
        limit = workload_limit(base_runs, out_tokens)
        for c in configs:
            runs = results[c][w]
            tps, tps_s = _med([r.get("output_tok_s") for r in runs])
            tpot, tpot_s = _med([r.get("mean_tpot_ms") for r in runs])
            step, step_s = _med([r.get("decode_step_ms") for r in runs])
            tps_all = [round(r["output_tok_s"], 1) for r in runs if r.get("output_tok_s")]
            n_ok = sum(len(r["requests"]) for r in runs)
            n_err = sum(len(r["errors"]) for r in runs)
            row = {"workload": w, "config": c, "requests": n_ok, "errors": n_err,
                   "output_tok_s": tps, "output_tok_s_spread": tps_s,
                   "tpot_ms": tpot, "tpot_ms_spread": tpot_s,
                   "decode_step_ms": step, "decode_step_ms_spread": step_s,
                   "runs": len(runs), "output_tok_s_each": tps_all,
                   "max_running": max((r.get("max_running") or 0) for r in runs) if runs else None,
                   "mean_running": _med([r.get("mean_running") for r in runs])[0],
                   "retracted_reqs": sum(r.get("retracted_reqs") or 0 for r in runs)}
            if base_tps and tps:
                row["tok_s_vs_base"] = tps / base_tps
            if native_tps and tps:
                row["tok_s_vs_native"] = tps / native_tps
            if base_tpot and tpot:
                row["tpot_vs_base"] = tpot / base_tpot
            if ref_tps and tps:
                row["tok_s_vs_ref"] = tps / ref_tps
            if ref_tpot and tpot:
                row["tpot_vs_ref"] = tpot / ref_tpot
            # Against base, and against ref and plain where they ran (base
            # too against plain: MTP's outputs against one token a step).
            for ref_cfg, key in (("base", "exactness"), ("ref", "exactness_vs_ref"),
                                 ("plain", "exactness_vs_plain")):
                if (c != ref_cfg and (c != "base" or ref_cfg == "plain") and c not in invalid
                        and results.get(ref_cfg, {}).get(w)):
                    row[key] = compare_runs(results[ref_cfg][w], runs, margin, tol)
            if limit:
                row["tok_s_vs_limit"] = (tps or 0) / limit["output_tok_s"]
            rows.append(row)
            ex = row.get("exactness")
            vs_ref = (f", x{row.get('tok_s_vs_ref', 0):.2f} ref" if ref_tps else "")
            tpot_ref = (f", x{row.get('tpot_vs_ref', 0):.2f} ref" if ref_tpot else "")
            print(f"{w:<11} {c:<7} {len(runs):>4} {n_ok:>3}/{n_err:<3}  "
                  f"{(tps or 0):9.1f} ± {(tps_s or 0):6.1f} (x{row.get('tok_s_vs_base', 0):.2f} base, "
                  f"x{row.get('tok_s_vs_native', 0):.2f} native{vs_ref})   "
                  f"{(tpot or 0):7.2f} ± {(tpot_s or 0):5.2f} (x{row.get('tpot_vs_base', 0):.2f}{tpot_ref})   "
                  f"{(step or 0):6.2f} ± {(step_s or 0):4.2f}   "
                  f"{row['max_running']}/{(row['mean_running'] or 0):.1f}"
                  + (f" (retracted {row['retracted_reqs']})" if row["retracted_reqs"] else "") + "   "
                  + (describe_exactness(ex, tol) if ex else "-")
                  + (f"; vs plain: {describe_exactness(row['exactness_vs_plain'], tol)}"
                     if row.get("exactness_vs_plain") else ""), flush=True)
        if limit:
            shares = ", ".join(f"{r['config']} {r['tok_s_vs_limit']:.2f}"
                               for r in rows[-len(configs):])  # this workload's, in order
            print(f"{w:<11} limit   ~{limit['output_tok_s']:.1f} tok/s "
                  f"(x{limit['output_tok_s'] / base_tps:.2f} base"
                  + (f", x{limit['output_tok_s'] / native_tps:.2f} native" if native_tps else "")
                  + f") = {limit['prompts']} prefills x {limit['prefill_s']:.3f} s ({limit['prefill_from']}) + "
                  f"{out_tokens - 1} steps x {limit['step_ms']:.2f} ms; share of it: {shares}",
                  flush=True)
            rows.append({"workload": w, "config": "limit", **limit,
                         "tok_s_vs_base": limit["output_tok_s"] / base_tps,
                         "tok_s_vs_native": (limit["output_tok_s"] / native_tps
                                             if native_tps else None)})
    return rows


if __name__ == "__main__":
    sys.exit(main())
