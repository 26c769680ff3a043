"""Function-level source patches: apply a unified diff to one pinned function.

A patch file holds one unified diff whose line numbers count from the first
line of the target's source text (see :mod:`pinned_source`). Hunks must match
exactly where they say; there is no fuzz, because a patch that lands
somewhere else in a changed function is worse than no patch. The patched
text is compiled in the target module's namespace and returned as a plain
function for a REPLACE hook.
"""

from __future__ import annotations

import __future__
import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from sglang_hisparse.pinned_source import PinnedSource
from sglang_hisparse.pins import PATCH_ROOT, pin_dir

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    def __init__(self, target: str, reason: str):
        super().__init__(f"{target}: {reason}")
        self.target = target
        self.reason = reason


def patch_file(version: str, target: str) -> Path:
    # This module's PATCH_ROOT, read at call time (a test points it elsewhere).
    return pin_dir(version, PATCH_ROOT) / f"{target}.diff"


@dataclass
class _Hunk:
    old_start: int
    lines: list[str]  # each starts with ' ', '-' or '+'


def _parse_hunks(target: str, diff: str) -> list[_Hunk]:
    hunks: list[_Hunk] = []
    for raw in diff.splitlines():
        if raw.startswith(("---", "+++")) and not hunks:
            continue
        m = _HUNK_HEADER.match(raw)
        if m:
            hunks.append(_Hunk(old_start=int(m.group(1)), lines=[]))
            continue
        if not hunks:
            continue
        if raw.startswith("\\"):  # "\ No newline at end of file"
            continue
        if raw == "":
            raw = " "  # editors strip the blank context line's space
        if raw[0] not in " +-":
            raise PatchError(target, f"malformed diff line {raw!r}")
        hunks[-1].lines.append(raw)
    if not hunks:
        raise PatchError(target, "patch file holds no hunk")
    return hunks


def apply_unified_diff(target: str, source: str, diff: str) -> str:
    """Apply ``diff`` to ``source`` strictly; raise PatchError naming the target."""
    src = source.splitlines()
    out: list[str] = []
    pos = 0  # 0-based index into src of the next line not yet copied
    for n, hunk in enumerate(_parse_hunks(target, diff), start=1):
        start = hunk.old_start - 1 if hunk.old_start > 0 else 0
        if start < pos:
            raise PatchError(target, f"hunk {n} overlaps the previous one")
        out.extend(src[pos:start])
        i = start
        for line in hunk.lines:
            tag, text = line[0], line[1:]
            if tag == "+":
                out.append(text)
                continue
            if i >= len(src) or src[i].rstrip() != text.rstrip():
                found = src[i] if i < len(src) else "<end of function>"
                raise PatchError(
                    target,
                    f"hunk {n} does not apply at line {i + 1}: "
                    f"expected {text.strip()!r}, found {found.strip()!r}",
                )
            if tag == " ":
                out.append(src[i])
            i += 1
        pos = i
    out.extend(src[pos:])
    return "\n".join(out) + "\n"


def _uses_private_names(tree: ast.AST) -> bool:
    # Names like self.__x are mangled only inside a class body; a method
    # compiled outside its class would look up the wrong attribute.
    for node in ast.walk(tree):
        name = getattr(node, "attr", None) or getattr(node, "id", None)
        if isinstance(name, str) and name.startswith("__") and not name.endswith("__"):
            return True
    return False


def compile_patched(pinned: PinnedSource, patched_text: str, owner: object | None):
    """Compile patched function text as if it were defined where the original was.

    ``owner`` is the class for a method (it becomes ``__class__`` so that a
    zero-argument ``super()`` keeps working) or None for a module function.
    """
    body = textwrap.dedent(patched_text)
    try:
        tree = ast.parse(body)
    except SyntaxError as exc:
        raise PatchError(pinned.target, f"patched source does not parse: {exc}") from exc
    if len(tree.body) != 1 or not isinstance(
        tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)
    ):
        raise PatchError(pinned.target, "a source patch must leave exactly one function")
    if _uses_private_names(tree):
        raise PatchError(pinned.target, "patched function uses name-mangled attributes")
    func_name = tree.body[0].name
    # Wrap in a factory whose parameter is named __class__: the compiler binds
    # a zero-argument super() in the inner function to that cell.
    factory_src = (
        "def __sglang_hisparse_factory__(__class__):\n"
        + textwrap.indent(body, "    ")
        + f"    return {func_name}\n"
    )
    module = sys.modules.get(pinned.module)
    if module is None:
        raise PatchError(pinned.target, f"module {pinned.module} is not imported")
    # A module written with ``from __future__ import annotations`` leaves its
    # annotations unevaluated (they may name TYPE_CHECKING-only imports): its
    # patched function is compiled the same way.
    future = module.__dict__.get("annotations")
    flags = future.compiler_flag if future is __future__.annotations else 0
    code = compile(
        factory_src,
        f"<sglang-hisparse patch of {pinned.target}>",
        "exec",
        flags=flags,
        dont_inherit=True,
    )
    scope: dict = {}
    exec(code, module.__dict__, scope)
    func = scope["__sglang_hisparse_factory__"](owner)
    func.__module__ = pinned.module
    func.__qualname__ = pinned.qualname
    return func
