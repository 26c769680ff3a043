"""The supported releases as data (patches/sglang-<version>/pin.json): what
they hold, that the manifest reads its hashes from them, and that the pin of
0.5.13.post1 is exactly what ``scripts/rebase.py --write`` produces from
that release's wheel, which doctor then accepts."""

from __future__ import annotations

import filecmp
import json
import subprocess
import textwrap
import sys

from conftest import REPO
from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS, pins
from sglang_hisparse.manifest import ENTRIES
from sglang_hisparse.pinned_source import read_pinned_source, sglang_version

POST1 = "0.5.13.post1"


def _rebase(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "rebase.py"), *args],
                          capture_output=True, text=True, cwd=str(REPO), timeout=600)


def test_supported_releases_are_the_pins():
    assert SUPPORTED_SGLANG_VERSIONS == ("0.5.13", POST1)
    assert pins.supported_versions() == SUPPORTED_SGLANG_VERSIONS
    assert pins.version_key("0.5.13") < pins.version_key(POST1) < pins.version_key("0.5.15")


def test_every_pin_hashes_every_entry_and_the_manifest_reads_them():
    targets = {e.target for e in ENTRIES}
    for version in SUPPORTED_SGLANG_VERSIONS:
        data = json.loads((pins.pin_dir(version) / pins.PIN_FILE).read_text())
        assert data["sglang"] == version and data["written_by"] == pins.WRITER
        assert set(data["sha256"]) == targets, version
        for e in ENTRIES:
            assert e.sha256[version] == data["sha256"][e.target]
    # The installed release is what its pin says, entry by entry.
    for e in ENTRIES:
        assert read_pinned_source(e.target).sha256 == e.sha256[sglang_version()], e.target


def test_the_post1_pin_is_what_rebase_writes(sglang_0_5_13_post1, tmp_path):
    # Without --write nothing is written.
    dry = _rebase(str(sglang_0_5_13_post1), "--out", str(tmp_path / "dry"))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert not (tmp_path / "dry").exists()
    assert "0 entries need a human" in dry.stdout
    assert dry.stdout.count("\n  same     ") == len(ENTRIES)

    proc = _rebase(str(sglang_0_5_13_post1), "--write", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written, committed = tmp_path / f"sglang-{POST1}", pins.pin_dir(POST1)
    cmp = filecmp.dircmp(written, committed)
    assert not (cmp.left_only or cmp.right_only or cmp.diff_files), (
        cmp.left_only, cmp.right_only, cmp.diff_files)
    # rebase compares with the newest pin, which is this one: a second run
    # over the same release is all "same" too.
    assert json.loads((written / pins.PIN_FILE).read_text())["rebased_from"] == "0.5.13"


def test_doctor_accepts_post1(sglang_0_5_13_post1):
    proc = subprocess.run([sys.executable, "-m", "sglang_hisparse", "doctor",
                           "--sglang-root", str(sglang_0_5_13_post1)],
                          capture_output=True, text=True, cwd=str(REPO), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"sglang {POST1}" in out and "supported: yes" in out
    assert f"{len(ENTRIES)} of {len(ENTRIES)} entries OK" in out


def test_rebase_writes_nothing_while_entries_need_a_person(sglang_0_5_15, tmp_path):
    proc = _rebase(str(sglang_0_5_15), "--write", "--out", str(tmp_path / "pins"))
    assert proc.returncode == 1
    assert "nothing written" in proc.stdout
    assert not (tmp_path / "pins").exists()
    # A changed dependency names what relies on it and how to take it.
    assert "re-read our mirror, then --accept it" in proc.stdout
    # Both allocators moved to their own module in 0.5.15: found by name and
    # source, offered for a person to confirm.
    for cls in ("HiSparseTokenToKVPoolAllocator", "DeepSeekV4HiSparseTokenToKVPoolAllocator"):
        (line,) = [ln for ln in proc.stdout.splitlines()
                   if ln.strip().startswith(f"moved?   sglang.srt.mem_cache.allocator.hisparse.{cls} ")]
        assert float(line.split(", ")[-1].split()[0]) > 0.9, line
    # A module that is gone is named as such, not as a missing def.
    assert "no module file for sglang.srt.model_executor.cuda_graph_runner" in proc.stdout


def test_refreshing_a_pin_takes_a_new_entry_and_a_rebase_refuses_it(tmp_path, sglang_0_5_15):
    """An entry added to the manifest gets its hash by refreshing each pin
    against its own release (``new``); rebasing onto another release first
    is refused for it (the old pin has no hash to compare with)."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / "scripts")!r})
        from pathlib import Path
        import rebase
        from sglang_hisparse.manifest import Entry, Kind, Process
        from sglang_hisparse.pinned_source import installed_sglang_root
        added = Entry(target="sglang.srt.managers.scheduler.Scheduler.run_batch",
                      kind=Kind.AFTER, sha256=None, why="test", native_in=None,
                      process=Process.SCHEDULER, impl="builtins:print")
        assert added.sha256 == {{}}  # in no pin yet
        rebase.ENTRIES = rebase.ENTRIES + (added,)
        rc = rebase.rebase(installed_sglang_root(), True, (), Path({str(tmp_path)!r}))
        print("RC", rc)
        rc = rebase.rebase(Path({str(sglang_0_5_15)!r}), False)
        print("RC", rc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(REPO), timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "  new      sglang.srt.managers.scheduler.Scheduler.run_batch (scheduler.py:" in out
    assert out.split("RC ")[1].startswith("0")
    # The refresh wrote the installed release's pin (CI runs this on both pins).
    written = json.loads((tmp_path / f"sglang-{sglang_version()}" / pins.PIN_FILE).read_text())
    assert "sglang.srt.managers.scheduler.Scheduler.run_batch" in written["sha256"]
    # A refresh keeps where the pin came from.
    assert written["rebased_from"] == pins.pin(sglang_version())["rebased_from"]
    assert ("  review   sglang.srt.managers.scheduler.Scheduler.run_batch: no hash in the "
            "0.5.13.post1 pin; refresh it first") in out


def test_a_moved_target_is_offered_confirmed_and_followed(tmp_path):
    """A release that moved a dependency to another module: rebase offers
    the new place, a person confirms it with --moved, the pin records it, and
    the loader's check reads the target there."""
    from releases import overlay_release

    from sglang_hisparse.pinned_source import installed_sglang_root

    target = "sglang.srt.mem_cache.common.release_kv_cache"
    src = read_pinned_source(target)
    common = src.path.read_text()
    real = installed_sglang_root()
    rel = src.path.relative_to(real)
    root = overlay_release(tmp_path / "release", {
        str(rel): common.replace(src.text, ""),
        str(rel.with_name("kv_release.py")): src.text,
    })
    new_place = "sglang.srt.mem_cache.kv_release.release_kv_cache"

    first = _rebase(str(root))
    assert first.returncode == 1
    assert f"moved?   {new_place} (kv_release.py:1, 1.00 alike)" in first.stdout
    assert f"(confirm one with --moved {target}=NEW)" in first.stdout

    out = tmp_path / "pins"
    done = _rebase(str(root), "--moved", f"{target}={new_place}", "--write", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert f"  moved    {target} -> {new_place}" in done.stdout
    assert f"  same     {target}\n" in done.stdout  # moved verbatim: the hash carries over
    installed = sglang_version()  # the overlay is the installed release, edited
    written = json.loads((out / f"sglang-{installed}" / pins.PIN_FILE).read_text())
    assert written["moved"] == {target: new_place}

    # The loader, reading that pin, checks the target at its new place.
    check = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from sglang_hisparse import pins
        pins.PATCH_ROOT = Path({str(out)!r}); pins.pin.cache_clear()
        from sglang_hisparse.manifest import ENTRIES
        from sglang_hisparse.plugin import check_entry
        (e,) = [e for e in ENTRIES if e.target == {target!r}]
        c = check_entry(e, {installed!r}, Path({str(root)!r}), build=False)
        print(c.ok, c.where, c.detail)
    """)], capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert check.stdout.split() [:2] == ["True", new_place], check.stdout + check.stderr[-2000:]


def test_a_renamed_target_is_offered_on_0_5_17(sglang_0_5_17):
    # 0.5.17 renamed ModelRunner.max_token_pool_size (model_runner.py:1190).
    proc = _rebase(str(sglang_0_5_17))
    assert proc.returncode == 1
    (line,) = [ln.strip() for ln in proc.stdout.splitlines()
               if ln.strip().startswith("renamed? sglang.srt.model_executor.model_runner."
                                        "ModelRunner.effective_max_total_num_tokens ")]
    assert float(line.split(", ")[-1].split()[0]) > 0.6, line
