#!/usr/bin/env python3
"""Rebase the manifest onto another SGLang release (the mechanical part).

    python scripts/rebase.py DIR [--write]          # or: --sglang-root DIR
    python scripts/rebase.py --hash TARGET... [--sglang-root DIR]

DIR holds the new release's ``sglang`` package (e.g. ``pip install --no-deps
--target DIR sglang==X``, or a ``pip download`` wheel unpacked). For every
manifest entry this prints one of:

  drop      the behaviour is native in the new release (native_in <= new)
  same      the target's source is unchanged: the pinned hash carries over
  reapply   a source patch whose hunks still match once re-anchored: with
            --write the re-anchored diff is written to patches/sglang-NEW/
  review    a hook target changed (or vanished): a human rewrites the hook/patch
  changed   a DEPENDS target changed: a human re-reads our code that mirrors or
            is called by it (printed after "relied on by"), then takes the hash
  gone      a DEPENDS target vanished: the same, and the entry is retargeted

and finally the sha256 values to paste into ``manifest.py`` for the new
version. Nothing here edits manifest.py: hashes are reviewed by a person.

``--hash`` prints the sha256 of any target (default: the installed SGLang),
the way the loader computes it: that is where a new entry's hash comes from.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS  # noqa: E402
from sglang_hisparse.manifest import ENTRIES, Kind  # noqa: E402
from sglang_hisparse.pinned_source import (  # noqa: E402
    TargetNotFound,
    read_pinned_source,
    sglang_version,
)
from sglang_hisparse.source_patch import (  # noqa: E402
    PatchError,
    apply_unified_diff,
    patch_file,
)


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in v.split("."))


def _reanchor(old_pinned: str, old_patched: str, new_source: str) -> str | None:
    """Carry the edit from old->patched over to new_source via a 3-way line merge."""
    sm = difflib.SequenceMatcher(a=old_pinned.splitlines(), b=new_source.splitlines(), autojunk=False)
    old_lines = old_pinned.splitlines()
    mapping = {}
    for a, b, n in sm.get_matching_blocks():
        for k in range(n):
            mapping[a + k] = b + k
    edits = difflib.SequenceMatcher(a=old_lines, b=old_patched.splitlines(), autojunk=False)
    new_lines = new_source.splitlines()
    out, cursor = [], 0
    for tag, i1, i2, j1, j2 in edits.get_opcodes():
        if tag == "equal":
            continue
        # Every old line the edit touches, and its neighbours, must map 1:1.
        anchors = [i for i in range(max(i1 - 1, 0), min(i2 + 1, len(old_lines)))]
        if any(i not in mapping for i in anchors) or (i1 == i2 and i1 - 1 not in mapping):
            return None
        start = mapping[i1] if i1 < i2 else mapping[i1 - 1] + 1
        end = mapping[i2 - 1] + 1 if i1 < i2 else start
        out.extend(new_lines[cursor:start])
        out.extend(old_patched.splitlines()[j1:j2])
        cursor = end
    out.extend(new_lines[cursor:])
    return "\n".join(out) + "\n"


def print_hashes(targets: list[str], root: Path | None) -> int:
    """``--hash``: one line per target, ``target sha256 file:line``."""
    missing = 0
    for target in targets:
        try:
            src = read_pinned_source(target, root)
        except TargetNotFound as exc:
            print(f"{target} NOT FOUND ({exc})")
            missing += 1
            continue
        print(f"{target} {src.sha256} {src.path.name}:{src.first_line}")
    return 1 if missing else 0


def _relied_on_by(entry) -> str:
    return "\n".join(f"             relied on by {who}" for who in entry.relied_on_by)


def rebase(root: Path, write: bool) -> int:
    new = sglang_version(root)
    old = SUPPORTED_SGLANG_VERSIONS[-1]
    print(f"rebasing the {old} manifest onto sglang {new} at {root}")
    hashes: dict[str, str] = {}
    needs_human = 0
    for e in ENTRIES:
        if e.native_in and _version_key(e.native_in) <= _version_key(new):
            print(f"  drop     {e.target} (native in {e.native_in})")
            continue
        try:
            src = read_pinned_source(e.target, root)
        except TargetNotFound as exc:
            if e.kind is Kind.DEPENDS:
                print(f"  gone     {e.target}: {exc}\n{_relied_on_by(e)}")
            else:
                print(f"  review   {e.target}: {exc}")
            needs_human += 1
            continue
        if src.sha256 == e.sha256.get(old):
            print(f"  same     {e.target}")
            hashes[e.target] = src.sha256
            continue
        if e.kind is Kind.DEPENDS:
            # The new hash is printed below, but only a person who has re-read
            # our side may paste it.
            print(
                f"  changed  {e.target} ({src.path.name}:{src.first_line}): "
                f"re-read our mirror\n{_relied_on_by(e)}"
            )
            hashes[e.target] = src.sha256
            needs_human += 1
            continue
        if e.kind is not Kind.SOURCE_PATCH:
            print(f"  review   {e.target}: source changed ({src.path.name}:{src.first_line})")
            needs_human += 1
            continue
        old_src = read_pinned_source(e.target).text  # the installed (pinned) release
        diff_text = patch_file(old, e.target).read_text()
        try:
            patched_old = apply_unified_diff(e.target, old_src, diff_text)
        except PatchError as exc:
            print(f"  review   {e.target}: pinned patch broken: {exc.reason}")
            needs_human += 1
            continue
        patched_new = _reanchor(old_src, patched_old, src.text)
        if patched_new is None:
            print(f"  review   {e.target}: edit does not re-anchor on the new source")
            needs_human += 1
            continue
        new_diff = "".join(
            difflib.unified_diff(
                src.text.splitlines(keepends=True),
                patched_new.splitlines(keepends=True),
                fromfile=f"a/{e.target}", tofile=f"b/{e.target}", n=2,
            )
        )
        print(f"  reapply  {e.target}")
        hashes[e.target] = src.sha256
        if write:
            path = patch_file(new, e.target)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(new_diff)
            print(f"           wrote {path}")
    print(f"\nsha256 for {new!r} (add to each entry's sha256 dict; 'changed' ones only "
          "after re-reading what relies on them):")
    for target, h in hashes.items():
        print(f"  {target}: {h}")
    print(f"\n{needs_human} entr{'y needs' if needs_human == 1 else 'ies need'} a human")
    return 1 if needs_human else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("dir", nargs="?", type=Path, default=None,
                    help="directory that holds the new release's sglang package")
    ap.add_argument("--sglang-root", type=Path, default=None, help="same as DIR")
    ap.add_argument("--write", action="store_true",
                    help="write re-anchored source patches to patches/sglang-NEW/")
    ap.add_argument("--hash", nargs="+", metavar="TARGET", default=None,
                    help="print the sha256 of these dotted targets and exit "
                         "(DIR / --sglang-root, default: the installed sglang)")
    args = ap.parse_args(argv)
    if args.dir is not None and args.sglang_root is not None and args.dir != args.sglang_root:
        ap.error("give the release directory once (DIR or --sglang-root)")
    root = args.dir or args.sglang_root
    if args.hash is not None:
        return print_hashes(args.hash, root)
    if root is None:
        ap.error("the new release's directory is required (DIR or --sglang-root DIR)")
    return rebase(root, args.write)


if __name__ == "__main__":
    sys.exit(main())
