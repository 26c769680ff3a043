#!/usr/bin/env python3
"""Rebase the manifest onto another SGLang release (the mechanical part).

    python scripts/rebase.py DIR [--write] [--accept TARGET ...] [--moved TARGET=NEW ...]
                             [--patch TARGET=DIFF ...] [--old-root OLD_DIR] [--out ROOT]
                             [--from VERSION]
    python scripts/rebase.py --hash TARGET... [--sglang-root DIR]

DIR holds the new release's ``sglang`` package and its ``*.dist-info``
(e.g. ``pip install --no-deps --target DIR sglang==X``, or a ``pip
download`` wheel unzipped). For every manifest entry this prints one of:

  drop      the behaviour is native in the new release (native_in <= new)
  same      the target's source is unchanged: the pinned hash carries over
  reapply   a source patch whose hunks still match once re-anchored
  review    a hook target changed (or vanished): a human re-reads the hook against
            the new source and fixes it, then ``--accept TARGET`` takes the new
            hash; a source patch that does not re-anchor is ported by hand to
            the new source and named with ``--patch TARGET=DIFF``
  changed   a DEPENDS target changed: a human re-reads our code that mirrors or
            is called by it (printed after "relied on by"); once they have,
            ``--accept TARGET`` takes its new hash
  accepted  such a target (or a changed hook target), taken with --accept
  ported    a source patch a person rewrote against the new source (--patch);
            it must apply there, and is written as that release's patch
  new       refreshing an existing pin (DIR is that release): an entry added
            since the pin was written; its hash is taken from DIR (a new source
            patch: with its diff named by ``--patch``, which must apply). Also an
            entry whose target first exists in DIR (``since``): the old
            release has none to compare with
  n/a       an entry whose target the release does not have (``since``, ``until``)
  gone      a DEPENDS target vanished: the same, and the entry is retargeted
  moved     a target a person placed elsewhere in the new release with
            ``--moved TARGET=NEW`` (review and gone lines list candidates:
            definitions of the same name, most alike first); the pin records
            the place and the loader installs there, the entry keeps its name

The pin compared with is the newest one before the new release (a release
that has a pin: its own, a refresh); ``--from VERSION`` names an older pin
instead, to repeat a port that is already pinned (e.g. to record it).

With ``--write``, and only when no entry is left for a person, it writes the
new pin: ``patches/sglang-NEW/pin.json`` (every target's sha256, see
:mod:`sglang_hisparse.pins`) and the source patches (carried over or
re-anchored), under ``--out`` (default: the package's ``patches/``). That
directory is what makes a release supported; nobody edits its hashes.

``--hash`` prints the sha256 of any target (default: the installed SGLang),
the way the loader computes it.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS, pins  # noqa: E402
from sglang_hisparse.manifest import ENTRIES, Kind  # noqa: E402
from sglang_hisparse.pinned_source import (  # noqa: E402
    TargetNotFound,
    definition_text,
    read_pinned_source,
    sglang_version,
)
from sglang_hisparse.source_patch import (  # noqa: E402
    PatchError,
    apply_unified_diff,
    patch_file,
)


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


def _definitions(root: Path) -> list[tuple[str, str, int, str]]:
    """Every module-level function or class and every method under
    ``root/sglang/srt``: (dotted target, file name, first line, source text)."""
    found = []
    base = Path(root)
    for path in sorted((base / "sglang" / "srt").rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        lines = text.splitlines(keepends=True)
        module = ".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__")

        def add(node, qual):
            first, source = definition_text(node, lines)
            found.append((f"{module}.{qual}", path.name, first, source))

        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(node, node.name)
                if isinstance(node, ast.ClassDef):
                    for sub in node.body:
                        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            add(sub, f"{node.name}.{sub.name}")
    return found


_DEFINITIONS: dict = {}


def moved_candidates(target: str, root: Path, top: int = 3, old_target: str | None = None,
                     old_root: Path | None = None) -> list[str]:
    """Where a target that is gone from its module may have gone: definitions
    of the same name (or, failing that, in the same module or class, or
    failing that any definition) in the new release, most alike first by
    their source text; for a person to confirm, never applied."""
    # Its source in the old release (``old_root``, default the installed
    # one): at the old pin's place, or where that release's own pin keeps it.
    places = dict.fromkeys((old_target or target,
                            pins.release_target(target, sglang_version(old_root))))
    for place in places:
        try:
            old = read_pinned_source(place, old_root)
            break
        except TargetNotFound:
            continue
    else:
        return []
    if str(root) not in _DEFINITIONS:
        _DEFINITIONS[str(root)] = _definitions(root)
    defs = _DEFINITIONS[str(root)]
    qual = old.qualname
    leaf = qual.rsplit(".", 1)[-1]
    owner = target.rsplit(".", 1)[0]
    old_lines = old.text.splitlines()
    # By name first: the same qualified name elsewhere (moved), then the same
    # leaf or the same owner (renamed, or a method that changed class), then
    # anything of a similar size (a function folded into a new class under
    # another name: 0.5.17's pool construction).
    for kind, pick in (
        ("moved?", lambda d: d[0].endswith("." + qual)),
        ("renamed?", lambda d: d[0].rsplit(".", 1)[-1] == leaf or d[0].rsplit(".", 1)[0] == owner),
        ("alike?", lambda d: 0.5 <= (d[3].count("\n") + 1) / (len(old_lines) + 1) <= 2.0),
    ):
        scored = []
        for dotted, name, line, text in filter(pick, defs):
            sm = difflib.SequenceMatcher(None, old_lines, text.splitlines(), autojunk=False)
            if sm.real_quick_ratio() < 0.3 or sm.quick_ratio() < 0.3:
                continue
            ratio = sm.ratio()
            if ratio >= (0.3 if kind != "alike?" else 0.5):
                scored.append((ratio, dotted, name, line))
        if scored:
            scored.sort(reverse=True)
            return [f"{kind:<9}{dotted} ({name}:{line}, {ratio:.2f} alike)"
                    for ratio, dotted, name, line in scored[:top]]
    return []


def _moved_lines(target: str, root: Path, old_target: str, old_root: Path | None) -> str:
    lines = moved_candidates(target, root, old_target=old_target, old_root=old_root)
    hint = f"\n           (confirm one with --moved {target}=NEW)" if lines else ""
    return "".join(f"\n           {c}" for c in lines) + hint


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


def older_pins(new: str) -> list[str]:
    """The supported releases before ``new``, oldest first."""
    return [v for v in SUPPORTED_SGLANG_VERSIONS if pins.version_key(v) < pins.version_key(new)]


def rebase(root: Path, write: bool, accept: tuple[str, ...] = (), out: Path | None = None,
           moved: dict[str, str] | None = None, ported: dict[str, Path] | None = None,
           old_root: Path | None = None, from_pin: str | None = None) -> int:
    new = sglang_version(root)
    # A pin that exists is refreshed against itself (keeping where it came
    # from); a new release is rebased from the newest pin before it (the
    # newest of all when there is none before it), or from the one named.
    older = older_pins(new)
    refresh = new in SUPPORTED_SGLANG_VERSIONS and from_pin is None
    if from_pin is not None:
        old = from_pin
    else:
        old = new if refresh else (older or SUPPORTED_SGLANG_VERSIONS)[-1]
    rebased_from = pins.pin(new)["rebased_from"] if refresh else old
    out = Path(out) if out is not None else pins.PATCH_ROOT
    print(f"rebasing the {old} manifest onto sglang {new} at {root}")
    hashes: dict[str, str] = {}
    diffs: dict[str, str] = {}  # target -> the new release's diff text
    locations: dict[str, str] = {}  # target -> where it lives in NEW, when elsewhere
    moved = dict(moved or {})
    ported = dict(ported or {})
    needs_human = 0
    for e in ENTRIES:
        if e.native_in and pins.version_key(e.native_in) <= pins.version_key(new):
            print(f"  drop     {e.target} (native in {e.native_in})")
            continue
        if not e.applies_to(new):
            print(f"  n/a      {e.target} (sglang {e.releases})")
            continue
        where_old = pins.release_target(e.target, old)
        where = moved.pop(e.target, where_old)
        if where != e.target:
            locations[e.target] = where
        if where != where_old:
            # Same leaf name: moved to another module or class; else renamed.
            how = "moved  " if where.rsplit(".", 1)[-1] == where_old.rsplit(".", 1)[-1] else "renamed"
            print(f"  {how}  {e.target} -> {where} (confirmed with --moved)")
        try:
            src = read_pinned_source(where, root)
        except TargetNotFound as exc:
            moved_hint = _moved_lines(e.target, root, where_old, old_root)
            if e.kind is Kind.DEPENDS:
                print(f"  gone     {e.target}: {exc}{moved_hint}\n{_relied_on_by(e)}")
            else:
                print(f"  review   {e.target}: {exc}{moved_hint}")
            needs_human += 1
            continue
        if old not in e.sha256:
            # Written against NEW when the old release has no such target.
            first_here = not e.applies_to(old)
            if refresh and e.kind is Kind.SOURCE_PATCH and e.target in ported:
                # A new source patch, written against this release's source
                # and named with --patch: it must apply here.
                diff_text = Path(ported.pop(e.target)).read_text()
                try:
                    apply_unified_diff(e.target, src.text, diff_text)
                except PatchError as exc:
                    print(f"  review   {e.target}: the new patch does not apply: {exc.reason}")
                    needs_human += 1
                    continue
                print(f"  new      {e.target} ({src.path.name}:{src.first_line}, patch given)")
                diffs[e.target] = diff_text
                hashes[e.target] = src.sha256
                continue
            if (not refresh and not first_here) or e.kind is Kind.SOURCE_PATCH:
                # Added since the old pin was written: refresh that pin first
                # (the entry was written against one of the pinned sources).
                print(f"  review   {e.target}: no hash in the {old} pin; refresh it first "
                      f"(rebase.py onto {old} --write)")
                needs_human += 1
                continue
            print(f"  new      {e.target} ({src.path.name}:{src.first_line})")
            hashes[e.target] = src.sha256
            continue
        # A source patch given with --patch is the person's, even on an
        # unchanged source (the ported branch below applies it).
        if src.sha256 == e.sha256.get(old) and not (
                e.kind is Kind.SOURCE_PATCH and e.target in ported):
            if e.kind is Kind.SOURCE_PATCH and not patch_file(old, e.target).is_file():
                # A target the old pin hashed (as a DEPENDS, say) that is a
                # source patch now: the person who wrote the patch ports it.
                print(f"  review   {e.target}: a source patch the {old} pin has no diff "
                      "for; write it against this source, then --patch it")
                needs_human += 1
                continue
            print(f"  same     {e.target}")
            hashes[e.target] = src.sha256
            if e.kind is Kind.SOURCE_PATCH:
                diffs[e.target] = patch_file(old, e.target).read_text()
            continue
        if e.kind is Kind.DEPENDS:
            if e.target in accept:
                print(f"  accepted {e.target} ({src.path.name}:{src.first_line})")
                hashes[e.target] = src.sha256
                continue
            print(
                f"  changed  {e.target} ({src.path.name}:{src.first_line}): "
                f"re-read our mirror, then --accept it\n{_relied_on_by(e)}"
            )
            needs_human += 1
            continue
        if e.kind is not Kind.SOURCE_PATCH:
            if e.target in accept:
                # A person re-read the hook (impl) against the new target.
                print(f"  accepted {e.target} ({src.path.name}:{src.first_line})")
                hashes[e.target] = src.sha256
                continue
            print(f"  review   {e.target}: source changed ({src.path.name}:{src.first_line}): "
                  "re-read our hook against it, then --accept it")
            needs_human += 1
            continue
        if e.target in ported:
            diff_text = Path(ported.pop(e.target)).read_text()
            try:
                apply_unified_diff(e.target, src.text, diff_text)
            except PatchError as exc:
                print(f"  review   {e.target}: the ported patch does not apply: {exc.reason}")
                needs_human += 1
                continue
            print(f"  ported   {e.target} ({src.path.name}:{src.first_line})")
            diffs[e.target] = diff_text
            hashes[e.target] = src.sha256
            continue
        installed = read_pinned_source(where_old, old_root)  # re-anchoring needs the old text
        if installed.sha256 != e.sha256.get(old):
            print(f"  review   {e.target}: the {old} source is needed to re-anchor the patch: "
                  f"give its directory with --old-root")
            needs_human += 1
            continue
        old_src = installed.text
        diff_text = patch_file(old, e.target).read_text()
        try:
            patched_old = apply_unified_diff(e.target, old_src, diff_text)
        except PatchError as exc:
            print(f"  review   {e.target}: pinned patch broken: {exc.reason}")
            needs_human += 1
            continue
        patched_new = _reanchor(old_src, patched_old, src.text)
        if patched_new is None:
            print(f"  review   {e.target}: edit does not re-anchor on the new source: "
                  "port it by hand, then --patch it")
            needs_human += 1
            continue
        diffs[e.target] = "".join(
            difflib.unified_diff(
                src.text.splitlines(keepends=True),
                patched_new.splitlines(keepends=True),
                fromfile=f"a/{e.target}", tofile=f"b/{e.target}", n=2,
            )
        )
        print(f"  reapply  {e.target}")
        hashes[e.target] = src.sha256
    for target in moved:
        print(f"  --moved {target}: not a manifest target")
        needs_human += 1
    for target in ported:
        print(f"  --patch {target}: not a source patch that needs porting")
        needs_human += 1
    print(f"\n{needs_human} entr{'y needs' if needs_human == 1 else 'ies need'} a human")
    if not write:
        return 1 if needs_human else 0
    if needs_human:
        print(f"nothing written: the pin for {new} needs every entry settled")
        return 1
    for target, text in diffs.items():
        path = pins.pin_dir(new, out) / f"{target}.diff"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    print(f"wrote {pins.write_pin(new, rebased_from, hashes, out, locations)} ({len(hashes)} targets)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("dir", nargs="?", type=Path, default=None,
                    help="directory that holds the new release's sglang package")
    ap.add_argument("--sglang-root", type=Path, default=None, help="same as DIR")
    ap.add_argument("--write", action="store_true",
                    help="write the new pin (pin.json and its source patches) to "
                         "ROOT/sglang-NEW/ when no entry needs a person")
    ap.add_argument("--accept", nargs="+", default=(), metavar="TARGET",
                    help="changed DEPENDS targets whose relied-on code a person has re-read")
    ap.add_argument("--moved", nargs="+", default=(), metavar="TARGET=NEW",
                    help="a manifest target that lives at NEW in this release (as the "
                         "moved? lines suggest, once a person has confirmed it)")
    ap.add_argument("--patch", nargs="+", default=(), metavar="TARGET=DIFF",
                    help="a source patch a person ported to this release: DIFF is the "
                         "unified diff against the new source (written as its patch)")
    ap.add_argument("--old-root", type=Path, default=None, metavar="OLD_DIR",
                    help="the release of the pin rebased from (its sources: moved-target "
                         "candidates, re-anchoring patches); default: the installed sglang")
    ap.add_argument("--out", type=Path, default=None, metavar="ROOT",
                    help="where pins are written (default: the package's patches/)")
    ap.add_argument("--from", dest="from_pin", default=None, metavar="VERSION",
                    help="rebase from this older pin instead of the newest one before "
                         "DIR's release (repeats a port that is already pinned)")
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
    def pairs(flag: str, values, what: str) -> dict[str, str]:
        out = {}
        for pair in values:
            target, sep, value = pair.partition("=")
            if not sep or not target or not value:
                ap.error(f"{flag} takes TARGET={what}, got {pair!r}")
            out[target] = value
        return out

    moved = pairs("--moved", args.moved, "NEW")
    ported = {t: Path(d) for t, d in pairs("--patch", args.patch, "DIFF").items()}
    if args.from_pin is not None:
        allowed = older_pins(sglang_version(root))
        if args.from_pin not in allowed:
            ap.error(f"--from takes a pin older than sglang {sglang_version(root)}: one of "
                     f"{', '.join(allowed) or '(none)'}, got {args.from_pin!r}")
    return rebase(root, args.write, tuple(args.accept), args.out, moved, ported, args.old_root,
                  args.from_pin)


if __name__ == "__main__":
    sys.exit(main())
