"""The SGLang releases we support, as data: ``patches/sglang-<version>/``.

A pin is a directory holding ``pin.json`` (the sha256 of every manifest
target's source in that release) and the release's source patches
(``<target>.diff``). ``scripts/rebase.py --write`` writes both, and only
when every entry of the manifest is settled for the release; nobody edits
a hash by hand. A release is supported exactly when its directory has a
``pin.json``: this module lists them, and the manifest's entries read their
hashes from here.

Reading it imports nothing but the standard library (``sglang_hisparse``'s
``__init__`` lists the pins at import).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

PATCH_ROOT = Path(__file__).resolve().parent / "patches"
PIN_FILE = "pin.json"
WRITER = "scripts/rebase.py --write"


def version_key(version: str) -> tuple:
    """Release order for what we pin (X.Y.Z and X.Y.Z.postN): a post release
    sorts after its base and before the next one."""
    return tuple(int(p.removeprefix("post")) if p.removeprefix("post").isdigit() else 0
                 for p in version.split("."))


def pin_dir(version: str, root: Path | None = None) -> Path:
    return Path(PATCH_ROOT if root is None else root) / f"sglang-{version}"


def supported_versions(root: Path | None = None) -> tuple[str, ...]:
    """Every release with a pin, oldest first (``root``: default PATCH_ROOT,
    read at call time)."""
    root = PATCH_ROOT if root is None else root
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return ()
    found = [n.removeprefix("sglang-") for n in names
             if n.startswith("sglang-") and os.path.isfile(os.path.join(root, n, PIN_FILE))]
    return tuple(sorted(found, key=version_key))


@functools.cache
def pin(version: str) -> dict:
    """The release's ``pin.json``: ``{"sglang", "rebased_from", "written_by",
    "sha256"}`` and, when a release moved targets, ``"moved"``."""
    return json.loads((pin_dir(version) / PIN_FILE).read_text())


def release_target(target: str, version: str) -> str:
    """Where the manifest's ``target`` lives in ``version``: itself, unless
    that release's pin records it as moved (a person confirmed the move at
    rebase time). Hashes, patches and doctor lines keep the manifest's name."""
    if version not in supported_versions():
        return target
    return pin(version).get("moved", {}).get(target, target)


def hashes(target: str) -> dict[str, str]:
    """``{version: sha256}`` of a target over the supported releases that pin it."""
    out = {}
    for version in supported_versions():
        digest = pin(version)["sha256"].get(target)
        if digest is not None:
            out[version] = digest
    return out


def write_pin(version: str, rebased_from: str | None, sha256: dict[str, str],
              root: Path | None = None, moved: dict[str, str] | None = None) -> Path:
    """``pin.json`` for a release (rebase.py's one writer of hashes)."""
    path = pin_dir(version, root) / PIN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"sglang": version, "rebased_from": rebased_from, "written_by": WRITER,
            "sha256": dict(sorted(sha256.items()))}
    if moved:
        body["moved"] = dict(sorted(moved.items()))
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path
