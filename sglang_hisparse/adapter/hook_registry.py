"""Installing hooks into SGLang: the only code that touches SGLang's ``HookRegistry``.

:mod:`sglang_hisparse.plugin` decides *what* to install (every manifest entry
checked first, all or nothing); this module does the installing and, when
SGLang did not apply something, the undoing:

* :func:`install` registers every hook with ``HookRegistry`` (a SOURCE_PATCH
  is a REPLACE with the patched function), applies them, and sets PROPERTY
  getters on their classes (HookRegistry cannot wrap a property). It returns
  the targets whose attribute is still the original afterwards: 0.5.13's
  ``apply_hooks`` logs and swallows a failing target, and skips a target it
  already applied another plugin's hooks to (ours is then registered but
  never installed), so the attribute itself is what tells.
* :func:`rollback` puts back everything :func:`install` changed.

0.5.13's ``HookRegistry`` has no API to take a hook back: only ``reset()``,
which would also drop other plugins' hooks. So :func:`rollback` edits its
private state, and only our part of it: our entries in ``_hooks`` (left there,
``load_plugins()``'s closing ``apply_hooks()`` or another plugin's would
install them again) and the ``_patched`` mark of the targets we put back to
their original (so that other plugins' hooks on them apply afresh). It also
undoes ``apply_hooks``'s propagation of a replaced object into every module
that had done ``from X import name`` (``_propagate_patch`` walks
``sys.modules``; we walk it back). Checked against 0.5.13's ``srt/plugins/hook_registry.py``;
``HookRegistry``, ``_propagate_patch`` and ``load_plugins`` are DEPENDS
entries of the manifest, so a release that changes them is refused until
this module is re-read.
"""

from __future__ import annotations

import pkgutil
import sys
from typing import Iterable, NamedTuple

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_hisparse.manifest import Kind


class Install(NamedTuple):
    target: str
    kind: Kind
    hook: object  # function, class, or property getter


# (target, owner, attribute, raw original, our hook) for everything installed,
# for rollback.
_installed: list[tuple[str, object, str, object, object]] = []


def owner_and_attr(target: str) -> tuple[object, str]:
    """The object that holds ``target``'s last component (imports its module)."""
    owner_path, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(owner_path), attr


def _hook_type(kind: Kind) -> HookType:
    return HookType.REPLACE if kind is Kind.SOURCE_PATCH else HookType[kind.value]


def install(items: Iterable[Install]) -> list[str]:
    """Install every item; return the targets SGLang left unchanged."""
    pending: list[tuple[str, object, object, str]] = []
    for item in items:
        if not item.kind.installs:
            continue
        owner, attr = owner_and_attr(item.target)
        raw = owner.__dict__[attr]
        _installed.append((item.target, owner, attr, raw, item.hook))
        if item.kind is Kind.PROPERTY:
            setattr(owner, attr, property(item.hook))
            continue
        HookRegistry.register(item.target, item.hook, _hook_type(item.kind))
        pending.append((item.target, owner, raw, attr))
    HookRegistry.apply_hooks()
    return [target for target, owner, raw, attr in pending if owner.__dict__.get(attr) is raw]


def rollback() -> None:
    """Undo everything :func:`install` did in this process."""
    for target, owner, attr, raw, hook in reversed(_installed):
        current = owner.__dict__.get(attr)
        restored = current is not raw
        if restored:
            setattr(owner, attr, raw)
            _unpropagate(current, raw)
        _forget(target, hook, restored)
    _installed.clear()


def _forget(target: str, hook: object, restored: bool) -> None:
    # Private state: see the module docstring (0.5.13 has no unregister).
    hooks = HookRegistry._hooks.get(target)
    if hooks is not None:
        hooks[:] = [h for h in hooks if h[1] is not hook]
        if not hooks:
            del HookRegistry._hooks[target]
    if restored:
        # The target is the original again: other plugins' hooks on it (if
        # any) apply afresh at the next apply_hooks. A target we did not
        # change keeps its mark (whatever is installed there is theirs).
        HookRegistry._patched.discard(target)


def _unpropagate(current: object, raw: object) -> None:
    # Undo HookRegistry._propagate_patch: modules that imported the original
    # by name were rebound to the wrapper.
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not d:
            continue
        for k, v in list(d.items()):
            if v is current:
                setattr(mod, k, raw)
