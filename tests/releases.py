"""Other SGLang releases for the tests, from whatever package index pip is
configured with: ``pip install --no-deps --target`` (the release's own
files and its ``*.dist-info``, nothing imported). A test that needs one is
skipped, with pip's reason, when no index answers."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

_OFFLINE = re.compile(
    r"No matching distribution found|Could not find a version|Failed to establish a new connection"
    r"|Temporary failure in name resolution|Name or service not known|Network is unreachable"
    r"|Connection (refused|reset|aborted)|timed out|ProxyError|SSLError|Max retries exceeded",
    re.I,
)


def sglang_release(tmp_path_factory, version: str):
    """The directory holding sglang==``version`` (for ``--sglang-root``)."""
    target = tmp_path_factory.mktemp(f"sglang-{version}")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--timeout", "15",
         "--retries", "1", "--target", str(target), f"sglang=={version}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 and _OFFLINE.search(proc.stderr):
        last = proc.stderr.strip().splitlines()[-1]
        pytest.skip(f"sglang {version} not reachable from the package index: {last}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return target


def overlay_release(tmp_path, files: dict):
    """A copy of the installed SGLang made of symlinks, with ``files``
    ({path relative to site-packages: text}) written in (new or replacing)."""
    from pathlib import Path

    from sglang_hisparse.pinned_source import installed_sglang_root

    real = installed_sglang_root()
    root = Path(tmp_path) / "site"
    root.mkdir(parents=True)
    for dist in real.glob("sglang-*.dist-info"):  # for sglang_version(root)
        (root / dist.name).symlink_to(dist)
    for rel, text in files.items():
        parts = Path(rel).parts
        src, dst = real, root
        for part in parts[:-1]:
            src, dst = src / part, dst / part
            if dst.is_symlink():  # a sibling linked on the way down: make it real
                dst.unlink()
            if not dst.exists():
                dst.mkdir()
                for child in src.iterdir():
                    (dst / child.name).symlink_to(child)
        target = dst / parts[-1]
        if target.is_symlink():
            target.unlink()
        target.write_text(text)
    return root


def installed_object(target: str):
    """The SGLang object a manifest target names, where the installed release
    keeps it (its pin records a target a release moved)."""
    import pkgutil

    from sglang_hisparse import pins
    from sglang_hisparse.pinned_source import sglang_version

    return pkgutil.resolve_name(pins.release_target(target, sglang_version()))


# Where the release builds its KV pools and their allocators: the model
# runner's mixin up to 0.5.15.post1, ``mem_cache/kv_cache_configurator.py``
# from 0.5.17 (the pin records the move of ``_init_pools``).
POOL_BUILDER = ("sglang.srt.model_executor.model_runner_kv_cache_mixin."
                "ModelRunnerKVCacheMixin._init_pools")


def pool_builder_module() -> str:
    """The name of the module that binds the pool classes it constructs."""
    return installed_object(POOL_BUILDER).__module__
