"""The plugin entry point: check the whole manifest, then install all of it or nothing.

SGLang calls :func:`register` (entry point ``sglang_hisparse`` in group
``sglang.srt.plugins``) from ``load_plugins()`` in the launcher and first thing
in every scheduler process, then applies the registered hooks. We check every
manifest entry against the installed SGLang before registering anything: an
unsupported release, a target whose source changed (a hooked one or a DEPENDS
one), or a patch that no longer applies leaves SGLang exactly as it was and
logs one error naming the cause.

Nothing here imports ``sglang.srt``: the installing itself (SGLang's
``HookRegistry``, the PROPERTY setters, the rollback) is
:mod:`sglang_hisparse.adapter.hook_registry`, imported only once every entry
passed.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS, pins
from sglang_hisparse.config import NATIVE_ENV
from sglang_hisparse.manifest import Entry, Kind, entries_for
from sglang_hisparse.pinned_source import (
    TargetNotFound,
    read_pinned_source,
    sglang_version,
)
from sglang_hisparse.source_patch import (
    PatchError,
    apply_unified_diff,
    compile_patched,
    patch_file,
)

logger = logging.getLogger("sglang_hisparse")

# NATIVE_ENV=1 runs SGLang's own HiSparse with only our argument handling and
# fixes (the "native" arm of the benchmarks); our data plane stays out.


@dataclass
class EntryCheck:
    entry: Entry
    ok: bool
    detail: str
    # What to install once every entry passed (None when only checked).
    hook: object | None = None
    # Where the target lives in this release ("" : the manifest's target).
    where: str = ""


@dataclass
class Activation:
    version: str | None
    applied: bool
    checks: list[EntryCheck] = field(default_factory=list)
    error: str | None = None


_activation: Activation | None = None


def _resolve_impl(entry: Entry):
    module_name, _, attr = (entry.impl or "").partition(":")
    if not module_name or not attr:
        raise ValueError(f"impl {entry.impl!r} is not 'module:attr'")
    return getattr(importlib.import_module(module_name), attr)


def _owner_class(target: str):
    """The class a method target belongs to (None for a module function);
    resolving it imports the target's module, which compile_patched needs."""
    owner = pkgutil.resolve_name(target.rsplit(".", 1)[0])
    return owner if isinstance(owner, type) else None


def check_entry(
    entry: Entry, version: str, root: Path | None = None, *, build: bool = True
) -> EntryCheck:
    """Check one entry against the SGLang at ``root`` (default: the installed one).

    With ``build`` the target module is imported and the hook object built, so
    that installing it afterwards cannot fail halfway; without it the check is
    purely textual (the doctor uses that for foreign installs).
    """
    where = pins.release_target(entry.target, version)
    try:
        pinned = read_pinned_source(where, root)
    except TargetNotFound as exc:
        return EntryCheck(entry, False, f"target not found ({exc})", where=where)
    want = entry.sha256.get(version)
    if want is None:
        return EntryCheck(entry, False, f"no pinned hash for sglang {version}")
    if pinned.sha256 != want:
        return EntryCheck(
            entry,
            False,
            f"source changed: sha256 {pinned.sha256[:12]} != pinned {want[:12]} "
            f"({pinned.path.name}:{pinned.first_line})",
        )
    hook = None
    try:
        if entry.kind is Kind.SOURCE_PATCH:
            path = patch_file(version, entry.target)
            if not path.is_file():
                return EntryCheck(entry, False, f"patch file missing: {path}")
            patched = apply_unified_diff(entry.target, pinned.text, path.read_text())
            if build:
                hook = compile_patched(pinned, patched, _owner_class(where))
        elif build and entry.kind.installs:
            hook = _resolve_impl(entry)
    except PatchError as exc:
        return EntryCheck(entry, False, f"patch does not apply: {exc.reason}")
    except Exception as exc:  # import errors, bad impl paths
        return EntryCheck(entry, False, f"cannot build hook: {type(exc).__name__}: {exc}")
    return EntryCheck(entry, True, "ok", hook, where=where)


def _install(checks: list[EntryCheck]) -> list[str]:
    """Install every checked hook; return the targets that did not apply."""
    from sglang_hisparse.adapter import hook_registry

    return hook_registry.install(
        hook_registry.Install(c.where or c.entry.target, c.entry.kind, c.hook) for c in checks
    )


def _rollback() -> None:
    from sglang_hisparse.adapter import hook_registry

    hook_registry.rollback()


def activate(
    entries: tuple[Entry, ...] | None = None, *, version: str | None = None
) -> Activation:
    """Check every entry, then install all of them or none."""
    try:
        version = version or sglang_version()
    except Exception as exc:
        return _refuse(Activation(None, False, error=f"sglang not found: {exc}"))
    if version not in SUPPORTED_SGLANG_VERSIONS:
        return _refuse(
            Activation(
                version,
                False,
                error=(
                    f"sglang {version} is not supported (this sglang-hisparse "
                    f"supports {', '.join(SUPPORTED_SGLANG_VERSIONS)}); "
                    "SGLang runs without HiSparse changes"
                ),
            )
        )
    if entries is None:
        entries = entries_for(native_only=os.environ.get(NATIVE_ENV) == "1")
    # (an entry a later release added has nothing to check on this one)
    checks = [check_entry(e, version) for e in entries if e.applies_to(version)]
    bad = [c for c in checks if not c.ok]
    if bad:
        listing = "; ".join(f"{c.entry.target}: {c.detail}" for c in bad)
        return _refuse(
            Activation(
                version,
                False,
                checks,
                error=(
                    f"{len(bad)} manifest entr{'y' if len(bad) == 1 else 'ies'} "
                    f"failed on sglang {version}, nothing was patched: {listing}"
                ),
            )
        )
    try:
        not_applied = _install(checks)
    except Exception as exc:  # e.g. a target attribute gone between check and install
        not_applied = [f"{type(exc).__name__}: {exc}"]
    if not_applied:
        _rollback()
        return _refuse(
            Activation(
                version,
                False,
                checks,
                error=f"hooks failed to apply, all rolled back: {', '.join(not_applied)}",
            )
        )
    installed = sum(c.entry.kind.installs for c in checks)
    logger.info(
        "sglang-hisparse active on sglang %s: %d manifest entries installed, "
        "%d dependencies unchanged",
        version,
        installed,
        len(checks) - installed,
    )
    return Activation(version, True, checks)


def _refuse(activation: Activation) -> Activation:
    logger.error("sglang-hisparse not activated: %s", activation.error)
    return activation


def register() -> None:
    """SGLang plugin entry point. Idempotent within a process."""
    global _activation
    if _activation is None:
        _activation = activate()


def current_activation() -> Activation | None:
    return _activation
