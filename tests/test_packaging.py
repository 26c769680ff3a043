"""The wheel: everything under sglang_hisparse/, entry point, package data."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO, run_python

PKG = REPO / "sglang_hisparse"


def test_wheel_layout_and_installed_plugin(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("sglang_hisparse-*.whl")
    names = zipfile.ZipFile(wheel).namelist()

    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"sglang_hisparse"}
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    ep_text = zipfile.ZipFile(wheel).read(ep).decode()
    assert "[sglang.srt.plugins]" in ep_text
    assert "sglang_hisparse = sglang_hisparse.plugin:register" in ep_text
    for data in (list(PKG.glob("jit_csrc/*.cuh")) + list(PKG.glob("patches/*/*.diff"))
                 + list(PKG.glob("patches/*/pin.json"))):
        assert data.relative_to(REPO).as_posix() in names, data
    # Every module of every subpackage (adapter/, engine/, pools/, kernels/ ...).
    for module in PKG.rglob("*.py"):
        if "__pycache__" not in module.parts:
            assert module.relative_to(REPO).as_posix() in names, module
    assert any(n.startswith("sglang_hisparse/patches/sglang-0.5.13/") for n in names)

    # Installed from the wheel (not the source tree): SGLang's loader finds it
    # and every manifest entry applies from the installed package data.
    site = tmp_path / "site"
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
         str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert inst.returncode == 0, inst.stderr[-3000:]
    proc = run_python(
        """
        import json, sys
        sys.path = [p for p in sys.path if p not in ("", %r)]
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import sglang_hisparse, sglang_hisparse.plugin as plugin
        import sglang_hisparse.adapter.hook_registry as hook_registry
        from sglang_hisparse.manifest import entries_for
        act = plugin.current_activation()
        print(json.dumps(dict(path=sglang_hisparse.__file__,
                              adapter=hook_registry.__file__,
                              applied=act.applied, error=act.error,
                              checked=len(act.checks),
                              # (those whose target the installed release has)
                              entries=len([e for e in entries_for(native_only=False)
                                           if e.applies_to(act.version)]))))
        """ % str(REPO),
        env={"PYTHONPATH": str(site)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["path"].startswith(str(site)) and res["adapter"].startswith(str(site)), res
    assert res["applied"], res["error"]
    assert res["checked"] == res["entries"]  # this mode's hooks and DEPENDS alike
