"""Install this work tree's package into a directory the way a wheel would,
without building one: the package's files and a dist-info whose
entry_points.txt names the plugin (SGLang finds it there) and the console
script, copied from setup.cfg.

Used by scripts/gpu_stages.sh and scripts/gpu_smoke.sh on the device machine, where pip's build took
23-28 s of every command (2026-12-06-s6); this takes well under a second.

    python3 scripts/install_tree.py TARGET_DIR
"""

import ast
import configparser
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def _version(init: pathlib.Path) -> str:
    """``__version__`` read from the source without running it (as
    setup.cfg's ``attr:`` does): running ``__init__`` imports the package,
    which is not importable where this script runs on the device."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise SystemExit(f"no __version__ in {init}")


def install(target: pathlib.Path) -> pathlib.Path:
    shutil.copytree(
        REPO / "sglang_hisparse",
        target / "sglang_hisparse",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    version = _version(REPO / "sglang_hisparse" / "__init__.py")

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    entry_points = cfg["options.entry_points"]
    sections = []
    for group in entry_points:
        lines = [line.strip() for line in entry_points[group].splitlines() if line.strip()]
        sections.append(f"[{group}]\n" + "".join(f"{line}\n" for line in lines))

    info = target / f"sglang_hisparse-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang-hisparse\nVersion: {version}\n"
    )
    (info / "entry_points.txt").write_text("\n".join(sections))
    (info / "top_level.txt").write_text("sglang_hisparse\n")
    (info / "INSTALLER").write_text("scripts/install_tree.py\n")
    (info / "RECORD").write_text("")
    return info


if __name__ == "__main__":
    # A flag is never a target: `--help` once installed a copy into ./--help.
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    print(install(pathlib.Path(sys.argv[1])))
