"""``python -m sglang_hisparse doctor``: is this SGLang one we can patch, entry by entry?

Reads the manifest and checks each entry against an SGLang install: the
running one by default, or any directory holding an ``sglang`` package
(``--sglang-root``), e.g. a newer release unpacked beside the pinned one
before a rebase. Checks on a foreign install are textual: nothing of it is
imported. Exit status 1 when the release is unsupported or any entry fails.

Per entry it prints the status, kind, process and target, then what we
install (``impl``) or ``hash only`` with what relies on it (DEPENDS), why
(shortened), and when the entry goes away (``native_in`` / ``removal``).
``--verbose`` adds the full text, each REPLACE's behaviour lines, the tests
that cover the entry and where upstream did it.

On a release that is not pinned (``--sglang-root`` of a newer wheel) every
failing entry also gets a ``todo`` line: what a person does about it, in
the words of the ``scripts/rebase.py`` step that settles it (drop, re-read
and ``--accept``, re-anchor or ``--patch``, find and ``--moved``), and the
listing ends with the release's torch / sglang-kernel requirement and the
count of each kind of work, which is the whole of a pin upgrade.

On the running install it then reports the PD transfer engine (Mooncake):
the installed build and version, whether it imports (the loader's error if
not) and which transports it can use (:mod:`sglang_hisparse.transfer_engine`).

``--kernels`` compiles the swap-in kernel variants a server with that
``--kernel-config`` (the ``--hisparse-config`` keys) and ``--kv-cache-dtype``
would build at its first decode step, so a node can warm its JIT cache
(for DSA rows with the IndexShare prefetch's plan-recording swap-in and
copy-only replay, which a model with shared indexer layers builds).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path

from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS, __version__, pins
from sglang_hisparse.arg_rules import dsa_row_bytes
from sglang_hisparse.manifest import DEPENDS, HOOKS, Entry, Kind, entries_of
from sglang_hisparse.pinned_source import (
    TargetNotFound,
    installed_sglang_root,
    sglang_distribution,
    sglang_version,
)

_INDENT = " " * 7


def _short(text: str, width: int = 100) -> str:
    """The first sentence of ``text``, cut to ``width`` characters."""
    first = re.split(r"[.;]\s+(?=[A-Z(])", text, maxsplit=1)[0].rstrip(".")
    if len(first) <= width:
        return first
    return first[: width - 3].rsplit(" ", 1)[0] + "..."


def _removal(entry: Entry) -> str:
    native = f"native in {entry.native_in}; " if entry.native_in else ""
    return native + (entry.removal or "keep")


def _wrapped(label: str, text: str) -> list[str]:
    lead = f"{_INDENT}{label:<10}"
    return textwrap.wrap(text, width=100, initial_indent=lead,
                         subsequent_indent=" " * len(lead)) or [lead]


# ------------------------------------------------ an unsupported release
# What a person does about one failing entry, by what failed. The verbs are
# scripts/rebase.py's (it settles each entry the same way and, once none is
# left, writes the pin), so a doctor listing is the rebase's to-do list.
TODO_KINDS = {
    "drop": "entries native in the release (nothing to do: rebase.py drops them)",
    "hook": "hooks to re-read against the changed target, then --accept",
    "patch": "source patches to re-anchor (rebase.py --old-root does it where the hunks "
             "still match) or port by hand (--patch)",
    "depends": "dependencies whose relying code to re-read, then --accept",
    "find": "targets gone from their module: find where they went, --moved (or drop ours)",
}


def todo(entry: Entry, detail: str, release: str) -> tuple[str, str]:
    """(kind, line) of what a person does about ``entry`` failing with
    ``detail`` on ``release`` (kind: a key of TODO_KINDS)."""
    if entry.native_in and pins.version_key(entry.native_in) <= pins.version_key(release):
        return "drop", f"none: native in {entry.native_in}, rebase.py drops the entry"
    ours = (", ".join(who.removeprefix("sglang_hisparse.") for who in entry.relied_on_by)
            if entry.kind is Kind.DEPENDS else entry.impl or "our patch")
    if detail.startswith("target not found"):
        return "find", (f"find where {entry.target.rsplit('.', 1)[-1]} went (rebase.py lists "
                        f"moved?/renamed? candidates), re-read {ours} against it, then "
                        f"--moved {entry.target}=NEW")
    at = re.search(r"\((\S+:\d+)\)$", detail)
    place = at.group(1) if at else "the new source"
    if entry.kind is Kind.SOURCE_PATCH:
        return "patch", (f"re-anchor the diff on {place} (rebase.py --old-root: the pinned "
                         f"release's install); if it does not, port it by hand and name it "
                         f"with --patch {entry.target}=DIFF")
    if entry.kind is Kind.DEPENDS:
        return "depends", f"re-read {ours} against {place}, then --accept {entry.target}"
    return "hook", (f"re-read {ours} against {place} (code that differs per release goes "
                    f"into adapter/releases/), then --accept {entry.target}")


def release_requirements(root: Path) -> str:
    """The torch and sglang-kernel pins of the sglang distribution at
    ``root`` (what a node, and the GPU loop, must run it with)."""
    try:
        requires = sglang_distribution(root).requires or ()
    except TargetNotFound:
        return "unknown (no sglang metadata)"
    wanted = [req.split(";")[0].strip() for req in requires
              if re.match(r"(torch|sglang-kernel|sgl-kernel)\s*[=<>~!]", req)]
    return ", ".join(wanted) or "no torch / sglang-kernel pin"


def todo_summary(release: str, root: Path, ref: str, todos: list[str]) -> list[str]:
    """The closing lines on an unsupported release: what it runs with and
    the count of each kind of work a pin upgrade from ``ref`` takes."""
    counts = Counter(todos)
    person = len(todos) - counts["drop"]
    lines = [f"\nto support sglang {release} (rebased from the {ref} pin):",
             f"  requires  {release_requirements(root)}"]
    for kind, what in TODO_KINDS.items():
        if counts[kind]:
            lines.append(f"  {counts[kind]:>4}  {what}")
    lines.append(
        f"  then      scripts/rebase.py {root} --old-root <{ref} install> --write "
        f"[--accept/--moved/--patch ...] writes patches/sglang-{release}/ once none of these "
        f"{person} entries is left to a person; add .ci/constraints-sglang-{release}.txt "
        "and run the tests on it (DEVELOPERS.md: A pin upgrade)")
    return lines


def entry_lines(entry: Entry, ok: bool, detail: str, version: str,
                verbose: bool = False, where: str = "", todo: str = "") -> list[str]:
    """What the doctor prints for one entry (the first line is the status line;
    a failure's reason follows it at once, after "->", then ``todo``: what a
    person does about it, on a release that is not pinned)."""
    lines = [
        f"  {'OK  ' if ok else 'FAIL'} {entry.kind.value:<12} {entry.process.value:<9} "
        f"{entry.target}"
    ]
    if not ok:
        lines.append(f"{_INDENT}-> {detail}")
    if todo:
        lines.append(f"{_INDENT}{'todo':<10}{todo}")
    if where and where != entry.target:
        lines.append(f"{_INDENT}{'at':<10}{where} (moved in sglang {version})")
    if entry.kind is Kind.DEPENDS:
        if verbose:
            lines.append(f"{_INDENT}{'impl':<10}hash only")
        else:
            users = ", ".join(who.removeprefix("sglang_hisparse.") for who in entry.relied_on_by)
            lines += _wrapped("impl", f"hash only; relied on by {users}")
    elif entry.kind is Kind.SOURCE_PATCH:
        patch = f"patches/sglang-{version}/{entry.target}.diff"
        lines.append(f"{_INDENT}impl      source patch {patch}")
    else:
        lines.append(f"{_INDENT}impl      {entry.impl}")
    if not verbose:
        lines.append(f"{_INDENT}why       {_short(entry.why)}")
        if entry.kind is not Kind.DEPENDS or entry.native_in:
            lines.append(f"{_INDENT}removal   {_short(_removal(entry))}")
        return lines
    lines += _wrapped("why", entry.why)
    for who in entry.relied_on_by:
        lines.append(f"{_INDENT}{'relied on':<10}{who}")
    for line in entry.behaviour:
        lines += _wrapped("behaviour", line)
    lines += _wrapped("removal", _removal(entry))
    if entry.upstream:
        lines += _wrapped("upstream", entry.upstream)
    lines.append(f"{_INDENT}{'scope':<10}{entry.scope.value}")
    lines.append(f"{_INDENT}{'tests':<10}{', '.join(entry.tests) or 'none (hash only)'}")
    return lines


def run_doctor(root: Path | None, out=sys.stdout, verbose: bool = False) -> int:
    from sglang_hisparse.plugin import check_entry

    foreign = root is not None
    try:
        root = Path(root) if foreign else installed_sglang_root()
        version = sglang_version(root if foreign else None)
    except Exception as exc:
        print(f"sglang: not found ({exc})", file=out)
        return 1
    supported = version in SUPPORTED_SGLANG_VERSIONS
    # An unsupported release is compared with the newest pin: the listing
    # then says which entries a rebase has to touch.
    ref = version if supported else SUPPORTED_SGLANG_VERSIONS[-1]
    print(f"sglang-hisparse {__version__}", file=out)
    print(f"sglang {version} at {root}", file=out)
    print(
        f"supported: {'yes' if supported else 'NO'} (pins: {', '.join(SUPPORTED_SGLANG_VERSIONS)})"
        + ("" if supported else f"; entries compared with the {ref} pin"),
        file=out,
    )
    print(
        "process: launcher (argument parsing), scheduler (every scheduler subprocess), "
        "both (plugin loading)",
        file=out,
    )
    failures = {"hooks": 0, "dependencies": 0}
    todos: list[str] = []  # on an unsupported release: the kind of each entry's work
    # Only the entries whose target the compared release has (``since``/``until``).
    hooks, depends = entries_of(ref, HOOKS), entries_of(ref, DEPENDS)
    for title, key, entries in (
        ("installed (hooks and patches)", "hooks", hooks),
        ("dependencies (DEPENDS: hash only; a change needs a person to re-read our side)",
         "dependencies", depends),
    ):
        print(f"\n{title}: {len(entries)}", file=out)
        for entry in entries:
            check = check_entry(entry, ref, root if foreign else None, build=not foreign)
            failures[key] += not check.ok
            work = ""
            if not supported and not check.ok:
                kind, work = todo(entry, check.detail, version)
                todos.append(kind)
            for line in entry_lines(entry, check.ok, check.detail, ref, verbose, check.where,
                                    work):
                print(line, file=out)
    bad = sum(failures.values())
    print(
        f"\n{len(hooks) + len(depends) - bad} of {len(hooks) + len(depends)} entries OK "
        f"({len(hooks) - failures['hooks']} of {len(hooks)} hooks, "
        f"{len(depends) - failures['dependencies']} of {len(depends)} dependencies)",
        file=out,
    )
    if not supported:
        for line in todo_summary(version, root, ref, todos):
            print(line, file=out)
    if not foreign:
        # This node's PD transport. Informational: a colocated server needs no
        # transfer engine, so it does not change the exit status.
        from sglang_hisparse import transfer_engine

        for line in transfer_engine.status_lines(transfer_engine.status()):
            print(line, file=out)
    return 0 if supported and bad == 0 else 1


# ---------------------------------------------------------------- kernels
# DSA latent row (DeepSeek-V3.2 / GLM-5: kv_lora_rank 512, qk_rope_head_dim
# 64), laid out as 0.5.13's ModelRunnerKVCacheMixin.calculate_mla_kv_cache_dim
# lays it out (a DEPENDS entry): bf16 stores 576 values of 2 B; FP8
# (flashmla_kv) stores the 512 latent values as fp8, one fp32 scale per
# 128 of them, and the rope part in bf16. The host pool's item_bytes and the
# swap-in kernel's row size are that width.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
KV_CACHE_DTYPES = ("bfloat16", "fp8_e4m3")


def row_bytes(kv_cache_dtype: str) -> int:
    """Bytes per token row of the DSA KV pool (bf16: 1152, fp8_e4m3: 656),
    by the same formula the startup host-memory check uses."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return dsa_row_bytes(KV_LORA_RANK, QK_ROPE_HEAD_DIM, kv_cache_dtype)


# DeepSeek-V3.2's index_topk, for a --kernel-config that names no top_k
# (doctor has no model to read it from).
DEFAULT_TOP_K = 2048


def kernel_variant_request(config_json: str | None, kv_cache_dtype: str, layout: str) -> dict:
    """The keyword arguments of the serving variants for this config.

    ``config_json`` is parsed by the ``--hisparse-config`` parser (unknown
    keys and bad values raise HiSparseConfigError listing what is allowed)
    and resolved as a server would resolve it.
    """
    from sglang_hisparse.config import parse_hisparse_config
    from sglang_hisparse.kernels import C4_ITEM_BYTES

    config = parse_hisparse_config(config_json)
    config = config.resolve(DEFAULT_TOP_K if config.top_k is None else config.top_k)
    item_bytes = C4_ITEM_BYTES if layout == "dsv4_c4" else row_bytes(kv_cache_dtype)
    return dict(
        top_k=config.top_k,
        hot_buffer_size=config.device_buffer_size,
        item_bytes=item_bytes,
        layout=layout,
        block_size=config.swap_in_block_size,
    )


def _serving_variants(compile_variants, layout: str) -> dict:
    # Serving builds the plain swap-in, and for DSA rows what an IndexShare
    # model (index_topk_pattern / index_topk_freq) adds: the anchor's
    # swap-in that records its miss plan and the copy-only replay of that
    # plan on each shared layer (engine/prefetch.py). No skip-IO, timing
    # probe or exactness kernel (benchmarks, tests and SGLANG_HISPARSE_CHECK
    # build those). Say so explicitly for every such switch compile_variants
    # has, whatever its defaults are.
    params = inspect.signature(compile_variants).parameters
    index_share = layout == "rows"  # DeepSeek-V4's C4 layers share no indexer
    axes = {name: (False,) for name in ("skip_io", "probe") if name in params}
    if "record_plan" in params:
        axes["record_plan"] = (False, True) if index_share else (False,)
    flags = {name: index_share for name in ("copy_planned",) if name in params}
    if index_share and "copy_planned_threads" in params:
        # the block shape SGLANG_HISPARSE_PREFETCH_GRID names (default 512)
        from sglang_hisparse.engine.prefetch import ReplayGrid

        axes["copy_planned_threads"] = (ReplayGrid.from_environ(os.environ).threads,)
    return {**axes, **flags}


def run_kernel_warmup(config_json: str | None, kv_cache_dtype: str = "bfloat16",
                      layout: str = "rows", out=sys.stdout, err=sys.stderr) -> int:
    from sglang_hisparse.config import FLAG, HiSparseConfigError

    try:
        request = kernel_variant_request(config_json, kv_cache_dtype, layout)
    except HiSparseConfigError as exc:
        # The same parser and messages as the server's flag, named as ours.
        print(str(exc).replace(FLAG, "doctor --kernel-config"), file=err)
        return 2
    except ValueError as exc:
        print(f"doctor --kernels: {exc}", file=err)
        return 2
    from sglang_hisparse import kernels

    if not kernels.nvcc_available():
        print("doctor --kernels: nvcc not found (put it on PATH or set CUDA_HOME); "
              "no kernel was compiled", file=err)
        return 1
    try:
        built = kernels.compile_variants(**request, **_serving_variants(kernels.compile_variants,
                                                                          layout))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"doctor --kernels: build failed: {type(exc).__name__}: {first}", file=err)
        return 1
    for name in built:
        print(f"  compiled {name}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-hisparse doctor")
    parser.add_argument(
        "--sglang-root",
        type=Path,
        default=None,
        help="directory that holds an sglang package (default: the installed one)",
    )
    parser.add_argument(
        "-v", "--verbose",
        action="store_true",
        help="also print each entry's full reasons, REPLACE behaviour lines, tests, upstream",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also compile the swap-in kernel variants a server with this config builds",
    )
    parser.add_argument(
        "--kernel-config",
        default=None,
        help="--hisparse-config JSON for --kernels, e.g. "
             '\'{"top_k": 2048, "device_buffer_size": 4096}\' '
             f"(top_k defaults to {DEFAULT_TOP_K}, DeepSeek-V3.2's index_topk)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="the server's --kv-cache-dtype, which sets the row size "
             f"(bfloat16: {row_bytes('bfloat16')} B, fp8_e4m3: {row_bytes('fp8_e4m3')} B)",
    )
    parser.add_argument(
        "--layout",
        choices=("rows", "dsv4_c4"),
        default="rows",
        help="rows: DSA models (DeepSeek-V3.2, GLM-5); dsv4_c4: DeepSeek-V4's C4 pages",
    )
    args = parser.parse_args(argv)
    if not args.kernels and (
        args.kernel_config is not None or args.kv_cache_dtype is not None or args.layout != "rows"
    ):
        parser.error("--kernel-config, --kv-cache-dtype and --layout need --kernels")
    rc = run_doctor(args.sglang_root, verbose=args.verbose)
    if args.kernels:
        rc = max(rc, run_kernel_warmup(
            args.kernel_config, args.kv_cache_dtype or "bfloat16", args.layout))
    return rc
