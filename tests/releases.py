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
