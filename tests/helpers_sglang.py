"""Run SGLang 0.5.13's real server-argument path on a CPU-only machine.

``prepare_server_args(argv)`` + ``check_server_args()`` run here as in the
launcher, with two concessions to the missing GPU (see the CPU CI notes):
``--device cuda`` is passed, and ``torch.cuda.get_device_capability`` is
shimmed to report SM90 (Hopper), which the DSA defaults ask for.

Hooks change SGLang process-wide and importing SGLang costs ~8 s, so
:func:`check_server_args_cases` runs many argument lists in ONE fresh
interpreter (with or without our plugin activated) and returns JSON results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Config-only DeepSeek-V3.2 (architectures DeepseekV32ForCausalLM, index_topk 2048).
TINY_DSV32 = Path(__file__).resolve().parent / "data" / "tiny-dsv32"

CUDA_CAPABILITY_SHIM = (
    "import torch\n"
    "torch.cuda.get_device_capability = lambda device=None: (9, 0)\n"
)

# Server-args fields reported back for every case that passes the check.
REPORTED_FIELDS = (
    "attention_backend",
    "page_size",
    "kv_cache_dtype",
    "dsa_prefill_backend",
    "dsa_decode_backend",
    "chunked_prefill_size",
    "max_total_tokens",
    "swa_full_tokens_ratio",
    "incremental_streaming_output",
)

_RESULT_MARK = "SERVER_ARGS_RESULTS "

_RUNNER = (
    CUDA_CAPABILITY_SHIM
    + r'''
import dataclasses, json, os, sys

cases = json.loads(sys.stdin.read())
activation = None
if ACTIVATE:
    from sglang_hisparse.plugin import activate
    act = activate()
    activation = {"applied": act.applied, "error": act.error}

from sglang.srt.server_args import prepare_server_args


def error_of(exc):
    return {"error_type": type(exc).__name__, "error": str(exc)}


results = {}
for name, case in cases.items():
    result = {"ok": False}
    saved_env = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    try:
        server_args = prepare_server_args(case["argv"])
        # Values SGLang's own __post_init__ would reject first, set after the
        # resolution to reach check_server_args (e.g. what an `assert` under
        # -O lets by), the way the release allows (0.5.17: ServerArgs.override).
        if case.get("set"):
            from sglang_hisparse.adapter import releases
            releases.current.override_server_args(server_args, "test: set", case["set"])
        result["stage"] = "check_server_args"
        server_args.check_server_args()
        result["ok"] = True
        result["fields"] = {f: getattr(server_args, f) for f in FIELDS}
        # What the model runner will read (through the package re-export,
        # as model_runner.py does).
        from sglang.srt.mem_cache.sparsity import parse_hisparse_config
        try:
            result["sparse_config"] = dataclasses.asdict(parse_hisparse_config(server_args))
        except Exception as exc:
            result["sparse_config_error"] = error_of(exc)
    except BaseException as exc:  # argparse exits with SystemExit
        result.update(error_of(exc))
        result.setdefault("stage", "prepare_server_args")
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results[name] = result

print(MARK + json.dumps({"activation": activation, "results": results}))
'''
)


def check_server_args_cases(
    cases: dict[str, dict], *, activate: bool, timeout: int = 300
) -> dict:
    """Parse and check each case in one fresh interpreter.

    ``cases``: name -> {"argv": [...], "set": {attr: value}, "env": {name:
    value}}; "set" is applied between prepare_server_args and
    check_server_args, "env" around both.
    Returns {"activation": {"applied", "error"} | None, "results": {name:
    {"ok", "stage", "error_type", "error", "fields", "sparse_config"}}}.
    """
    code = (
        f"ACTIVATE = {activate!r}\nFIELDS = {REPORTED_FIELDS!r}\nMARK = {_RESULT_MARK!r}\n"
        + _RUNNER
    )
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(REPO),
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK) :])
    raise AssertionError(
        f"server-args runner failed (rc={proc.returncode}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
