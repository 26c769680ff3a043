"""Read a function's or class's source straight from an SGLang install.

The manifest pins every target by the sha256 of its source text. Both the
loader (live install) and the doctor (any install, even one whose modules
would not import beside the running torch) need that text, so it is read
from the ``.py`` files with :mod:`ast` and never by importing the target.

"Source text" of a target is the full lines from its first decorator (or
its ``def``/``class`` line) to its last line, indentation kept. That is
what a source patch is written against, line 1 being the first of them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


class TargetNotFound(LookupError):
    pass


@dataclass(frozen=True)
class PinnedSource:
    target: str  # dotted path, e.g. "sglang.srt.managers.scheduler.Scheduler.foo"
    module: str  # "sglang.srt.managers.scheduler"
    qualname: str  # "Scheduler.foo"
    path: Path
    first_line: int  # 1-based line of the first decorator / def
    text: str

    @property
    def sha256(self) -> str:
        return sha256_text(self.text)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def installed_sglang_root() -> Path:
    """Directory that holds the ``sglang`` package of the running interpreter."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise TargetNotFound("sglang is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent


def sglang_distribution(root: Path | None = None) -> importlib.metadata.Distribution:
    """The sglang distribution installed at ``root`` (default: ours): its
    version and its requirements."""
    if root is None:
        return importlib.metadata.distribution("sglang")
    for dist in importlib.metadata.distributions(path=[str(root)]):
        if (dist.metadata["Name"] or "").lower() == "sglang":
            return dist
    raise TargetNotFound(f"no sglang distribution metadata under {root}")


def sglang_version(root: Path | None = None) -> str:
    """Version of the sglang distribution installed at ``root`` (default: ours)."""
    if root is None:
        return importlib.metadata.version("sglang")
    return sglang_distribution(root).version


def _module_file(root: Path, parts: list[str]) -> tuple[int, Path]:
    # The longest dotted prefix that names a module file is the module.
    for i in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:i])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return i, candidate
    raise TargetNotFound(f"no module file for {'.'.join(parts)} under {root}")


@lru_cache(maxsize=None)
def _parse(path: Path) -> tuple[ast.Module, tuple[str, ...]]:
    text = path.read_text(encoding="utf-8")
    return ast.parse(text, filename=str(path)), tuple(text.splitlines(keepends=True))


def definition_text(node: ast.stmt, lines) -> tuple[int, str]:
    """A def's or class's first line (its first decorator's) and its source
    text, from the file's lines (with line ends), as the manifest hashes it."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return first, "".join(lines[first - 1 : node.end_lineno])


def read_pinned_source(target: str, root: Path | None = None) -> PinnedSource:
    root = installed_sglang_root() if root is None else Path(root)
    parts = target.split(".")
    n_mod, path = _module_file(root, parts)
    qual = parts[n_mod:]
    if not qual:
        raise TargetNotFound(f"{target} names a module, not a function or class")
    tree, lines = _parse(path)
    body: list[ast.stmt] = tree.body
    node = None
    for name in qual:
        node = None
        for stmt in body:
            if (
                isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and stmt.name == name
            ):
                node = stmt  # last definition wins, as at runtime
        if node is None:
            if path.name == "__init__.py" and (path.parent / name).is_dir():
                # The module file is gone (its package is still there), not
                # a def: name the first missing module.
                depth = n_mod + qual.index(name) + 1
                while depth < len(parts) and root.joinpath(*parts[:depth]).is_dir():
                    depth += 1
                missing = ".".join(parts[:depth])
                raise TargetNotFound(f"{target}: no module file for {missing} under {root}")
            raise TargetNotFound(f"{target}: '{name}' not found in {path}")
        body = node.body if isinstance(node, ast.ClassDef) else []
    first, text = definition_text(node, lines)
    return PinnedSource(
        target=target,
        module=".".join(parts[:n_mod]),
        qualname=".".join(qual),
        path=path,
        first_line=first,
        text=text,
    )
