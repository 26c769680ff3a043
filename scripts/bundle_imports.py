#!/usr/bin/env python3
"""Will the device import what a server imports? Checked here, before a run.

The lent H200's image has some packages (``scripts/device_image_packages.txt``,
its ``pip list``); a bundle carries the rest (the kit's, ``pack_pin.sh``'s,
``pack_dsv4.sh``'s). A module the server imports at the top of a file that
neither holds ends a device run at start-up (0.5.17 and xgrammar: one cold
machine spent). This script imports the server's modules with ``python -S``
from a directory of links to only the packages the image and the bundles
hold (taken from a local venv of the same SGLang release, which has them
all), and names the first missing package of each module and the chain of
imports that reached it.

    python3 scripts/bundle_imports.py --python .venv/bin/python --bundle .bundle
    python3 scripts/bundle_imports.py --python .venv-017/bin/python --bundle .bundle-0.5.17
    python3 scripts/bundle_imports.py --python .venv/bin/python --bundle .bundle \\
        --with tilelang,z3-solver --dsv4        # the dsv4 stage's tarball adds these

What it cannot see: imports inside functions (taken at model load, graph
capture or the first request), shared libraries, and version differences
between the venv's packages and the image's. Exit 1 when a module fails.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVICE_PACKAGES = HERE / "device_image_packages.txt"

# What a DeepSeek-V3.2 server with HiSparse and MTP imports at module level:
# the launcher, its HTTP server and managers, the scheduler and model runner,
# the model, its attention backend, the EAGLE v2 worker, the coordinator.
SERVER_MODULES = [
    "sglang.launch_server", "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.data_parallel_controller",
    "sglang.srt.model_executor.model_runner", "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.deepseek_nextn", "sglang.srt.layers.attention.dsa_backend",
    "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.managers.hisparse_coordinator",
]
# DeepSeek-V4 adds its model (srt/layers/mhc.py imports tilelang at the top),
# its attention backend and the CUDA modules of its indexer and compressor.
DSV4_MODULES = [
    "sglang.srt.models.deepseek_v4", "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.layers.attention.dsv4.indexer", "sglang.srt.layers.attention.dsv4.compressor",
    "sglang.srt.layers.attention.dsv4.tilelang_kernel", "sglang.srt.layers.attention.dsv4.metadata",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",
]

_WALK = r"""
import importlib, json, sys, traceback
out = {}
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
        out[name] = None
    except BaseException as exc:
        frames = [f"{f.filename.split('/farm/')[-1]}:{f.lineno}"
                  for f in traceback.extract_tb(exc.__traceback__)
                  if "importlib" not in f.filename]
        out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300],
                     "missing": getattr(exc, "name", None), "chain": frames[-6:]}
print("@@" + json.dumps(out))
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_dists(path: Path) -> set[str]:
    return {norm(line.split("==")[0]) for line in path.read_text().splitlines()
            if "==" in line and not line.startswith("#")}


def bundle_dists(path: Path) -> set[str]:
    """Distribution names of a bundle: a site directory, a directory of
    ``site.tar.xz.NN`` parts, or one .tar.xz; read from its *.dist-info names."""
    names: list[str] = []
    parts = sorted(path.glob("site.tar.xz.*")) if path.is_dir() else [path]
    if path.is_dir() and not parts:
        names = [p.name for p in path.iterdir()]
    else:
        listing = subprocess.run(f"cat {' '.join(map(str, parts))} | xz -dc | tar -t",
                                 shell=True, capture_output=True, text=True, check=True).stdout
        names = [seg for line in listing.splitlines() for seg in line.split("/")]
    return {norm(n[: -len(".dist-info")].rsplit("-", 1)[0]) for n in names
            if n.endswith(".dist-info")}


def farm(python: str, keep: set[str], into: Path) -> int:
    """Link every top-level entry of the venv's distributions named in keep."""
    code = r"""
import importlib.metadata as md, json, re, sys
site = next(p for p in sys.path if p.endswith("site-packages"))
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
tops = {}
for d in md.distributions():
    tops.setdefault(norm(d.metadata["Name"]), set()).update(
        f.parts[0] for f in (d.files or []) if f.parts[0] not in ("..", "__pycache__"))
print(json.dumps({"site": site, "tops": {k: sorted(v) for k, v in tops.items()}}))
"""
    info = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)
    site, n = Path(info["site"]), 0
    for dist, tops in info["tops"].items():
        if dist not in keep:
            continue
        for top in tops:
            src, dst = site / top, into / top
            if src.exists() and not dst.exists() and not dst.is_symlink():
                dst.symlink_to(src)
                n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="a venv's python with this release installed")
    ap.add_argument("--bundle", action="append", default=[], type=Path,
                    help="a bundle (site dir, dir of site.tar.xz.NN, or .tar.xz); repeatable")
    ap.add_argument("--with", dest="extra", default="",
                    help="more distributions the device will have, comma-separated")
    ap.add_argument("--device-packages", type=Path, default=DEVICE_PACKAGES)
    ap.add_argument("--modules", default=",".join(SERVER_MODULES))
    ap.add_argument("--dsv4", action="store_true", help="also DeepSeek-V4's model")
    args = ap.parse_args(argv)

    keep = device_dists(args.device_packages)
    for b in args.bundle:
        keep |= bundle_dists(b)
    keep |= {norm(x) for x in args.extra.split(",") if x}
    modules = args.modules.split(",") + (DSV4_MODULES if args.dsv4 else [])
    with tempfile.TemporaryDirectory(prefix="bundle-imports-") as tmp:
        root = Path(tmp) / "farm"
        root.mkdir()
        linked = farm(args.python, keep, root)
        proc = subprocess.run(
            [args.python, "-S", "-c", _WALK, ",".join(modules)], capture_output=True, text=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1",
                 "HOME": tmp})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("@@")), None)
    if line is None:
        print(proc.stdout[-2000:], proc.stderr[-3000:], sep="\n")
        return 2
    results = json.loads(line[2:])
    print(f"{len(keep)} distributions on the device ({args.device_packages.name} + "
          f"{', '.join(map(str, args.bundle)) or 'no bundle'}), {linked} entries linked")
    missing: dict[str, list[str]] = {}
    for name, failure in results.items():
        if failure is None:
            print(f"  ok    {name}")
            continue
        print(f"  FAIL  {name}: {failure['error']}")
        print("        " + " <- ".join(reversed(failure["chain"])))
        if failure["missing"]:
            missing.setdefault(failure["missing"].split(".")[0], []).append(name)
    for pkg, by in missing.items():
        print(f"missing: {pkg} (first missing import of {len(by)} module(s); add its "
              f"distribution to the bundle and run this again)")
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
