"""Install this work tree's package into a directory the way a wheel would,
without building one: the package's files and a dist-info whose
entry_points.txt names the plugin (SGLang finds it there) and the console
script, copied from setup.cfg.

Used by scripts/gpu_stages.sh and scripts/gpu_smoke.sh on the device machine, where pip's build took
23-28 s of every command (2026-12-06-s6); this takes well under a second.

    python3 scripts/install_tree.py TARGET_DIR
"""

import configparser
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def install(target: pathlib.Path) -> pathlib.Path:
    shutil.copytree(
        REPO / "sglang_hisparse",
        target / "sglang_hisparse",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    namespace: dict = {}
    init = target / "sglang_hisparse" / "__init__.py"
    exec(compile(init.read_text(), str(init), "exec"), namespace)
    version = namespace["__version__"]

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
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(install(pathlib.Path(sys.argv[1])))
