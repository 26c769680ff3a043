"""``python -m sglang_hisparse doctor``: is this SGLang one we can patch, entry by entry?

Reads the manifest and checks each entry against an SGLang install: the
running one by default, or any directory holding an ``sglang`` package
(``--sglang-root``), e.g. a newer release unpacked beside the pinned one
before a rebase. Checks on a foreign install are textual: nothing of it is
imported. Exit status 1 when the release is unsupported or any entry fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS, __version__
from sglang_hisparse.manifest import ENTRIES
from sglang_hisparse.pinned_source import installed_sglang_root, sglang_version


def run_doctor(root: Path | None, out=sys.stdout) -> int:
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
    failures = 0
    for entry in ENTRIES:
        check = check_entry(entry, ref, root if foreign else None, build=not foreign)
        failures += not check.ok
        native = f"native in {entry.native_in}" if entry.native_in else "not native upstream"
        print(
            f"  {'OK  ' if check.ok else 'FAIL'} {entry.kind.value:<12} {entry.target}"
            f"  [{entry.scope.value}; {native}]"
            + ("" if check.ok else f"\n         -> {check.detail}"),
            file=out,
        )
    print(
        f"{len(ENTRIES) - failures} of {len(ENTRIES)} entries OK",
        file=out,
    )
    return 0 if supported and failures == 0 else 1


def run_kernel_warmup(config_json: str | None, out=sys.stdout) -> int:
    from sglang_hisparse.kernels import compile_variants

    cfg = json.loads(config_json) if config_json else {}
    built = compile_variants(**cfg)
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
        "--kernels",
        action="store_true",
        help="also compile every JIT kernel variant the given config needs",
    )
    parser.add_argument(
        "--kernel-config",
        default=None,
        help='JSON for the kernel variants, e.g. {"top_k": 2048, "hot_buffer_size": 4096}',
    )
    args = parser.parse_args(argv)
    rc = run_doctor(args.sglang_root)
    if args.kernels:
        rc = max(rc, run_kernel_warmup(args.kernel_config))
    return rc
