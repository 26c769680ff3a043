"""The supported releases as data (patches/sglang-<version>/pin.json): what
they hold, that the manifest reads its hashes from them, and that the pin of
every release but the primary one (0.5.13.post1, 0.5.15.post1, 0.5.17) is exactly
what ``scripts/rebase.py --write`` produces from that release's wheel, which
doctor then accepts (CI runs the whole suite on the primary and the newest
pin; these checks are what the others get)."""

from __future__ import annotations

import filecmp
import json
import subprocess
import textwrap
import sys

import pytest

from conftest import REPO, run_doctor, run_rebase
from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS, pins
from sglang_hisparse.manifest import ENTRIES, entries_of
from sglang_hisparse.pinned_source import read_pinned_source, sglang_version

POST1 = "0.5.13.post1"
POST1_15 = "0.5.15.post1"
V17 = "0.5.17"
# Every pin but the primary one, with the fixture that downloads its wheel
# and the pin it was rebased from.
OTHER_PINS = (
    pytest.param(POST1, "sglang_0_5_13_post1", "0.5.13", id=POST1),
    pytest.param(POST1_15, "sglang_0_5_15_post1", POST1, id=POST1_15),
    pytest.param(V17, "sglang_0_5_17", POST1_15, id=V17),
)


def test_supported_releases_are_the_pins():
    assert SUPPORTED_SGLANG_VERSIONS == ("0.5.13", POST1, POST1_15, V17)
    assert pins.supported_versions() == SUPPORTED_SGLANG_VERSIONS
    assert pins.version_key("0.5.13") < pins.version_key(POST1) < pins.version_key("0.5.15")
    assert pins.version_key("0.5.15") < pins.version_key(POST1_15) < pins.version_key(V17)


def test_every_pin_hashes_every_entry_and_the_manifest_reads_them():
    for version in SUPPORTED_SGLANG_VERSIONS:
        data = json.loads((pins.pin_dir(version) / pins.PIN_FILE).read_text())
        assert data["sglang"] == version and data["written_by"] == pins.WRITER
        # Every entry whose target the release has (``since``), no other.
        assert set(data["sha256"]) == {e.target for e in entries_of(version)}, version
        for e in entries_of(version):
            assert e.sha256[version] == data["sha256"][e.target]
    assert {e.target for e in ENTRIES} - {e.target for e in entries_of("0.5.13")} == {
        "sglang.srt.managers.scheduler.Scheduler.release_host_resources",
        "sglang.srt.model_executor.model_runner.ModelRunner._prepare_eager_forward_batch",
        "sglang.srt.configs.model_config.dsa_layer_skips_topk",
        "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla."
        "DeepseekMLAForwardMixin.should_run_indexer",
        # 0.5.17's pool construction (mem_cache/kv_cache_configurator.py), its
        # coordinator construction and its PD prealloc helper.
        "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
        "_build_token_to_kv_pool_allocator",
        "sglang.srt.disaggregation.decode.alloc_for_decode_prealloc_hisparse",
        # DeepSeek-V4's request-scoped C128 state (0.5.15 on), which a retracted
        # request takes to its new slot.
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.clear_c128_req_state",
    }
    # The installed release is what its pin says, entry by entry (at the
    # place the pin records for a moved one).
    for e in entries_of(sglang_version()):
        where = pins.release_target(e.target, sglang_version())
        assert read_pinned_source(where).sha256 == e.sha256[sglang_version()], e.target


@pytest.mark.parametrize(("version", "fixture", "rebased_from"), OTHER_PINS)
def test_the_pin_is_what_rebase_writes(version, fixture, rebased_from, request, tmp_path):
    release = request.getfixturevalue(fixture)
    # Without --write nothing is written.
    dry = run_rebase(str(release), "--out", str(tmp_path / "dry"))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert not (tmp_path / "dry").exists()
    assert "0 entries need a human" in dry.stdout
    # rebase compares a release that has a pin with that pin: every entry is
    # "same" (moved ones at the place the pin records) and its patches carry over.
    assert dry.stdout.count("\n  same     ") == len(entries_of(version))

    proc = run_rebase(str(release), "--write", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written, committed = tmp_path / f"sglang-{version}", pins.pin_dir(version)
    cmp = filecmp.dircmp(written, committed)
    assert not (cmp.left_only or cmp.right_only or cmp.diff_files), (
        cmp.left_only, cmp.right_only, cmp.diff_files)
    assert json.loads((written / pins.PIN_FILE).read_text())["rebased_from"] == rebased_from


@pytest.mark.parametrize(("version", "fixture", "rebased_from"), OTHER_PINS)
def test_doctor_accepts_the_pin(version, fixture, rebased_from, request):
    release = request.getfixturevalue(fixture)
    proc = run_doctor("--sglang-root", str(release))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"sglang {version}" in out and "supported: yes" in out
    n = len(entries_of(version))
    assert f"{n} of {n} entries OK" in out


def test_rebase_writes_nothing_while_entries_need_a_person(sglang_0_5_15, tmp_path):
    proc = run_rebase(str(sglang_0_5_15), "--write", "--out", str(tmp_path / "pins"))
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

    first = run_rebase(str(root))
    assert first.returncode == 1
    assert f"moved?   {new_place} (kv_release.py:1, 1.00 alike)" in first.stdout
    assert f"(confirm one with --moved {target}=NEW)" in first.stdout

    out = tmp_path / "pins"
    done = run_rebase(str(root), "--moved", f"{target}={new_place}", "--write", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert f"  moved    {target} -> {new_place}" in done.stdout
    assert f"  same     {target}\n" in done.stdout  # moved verbatim: the hash carries over
    installed = sglang_version()  # the overlay is the installed release, edited
    written = json.loads((out / f"sglang-{installed}" / pins.PIN_FILE).read_text())
    # (beside what the installed release's own pin records as moved)
    assert written["moved"] == {**pins.pin(installed).get("moved", {}), target: new_place}

    # The loader, reading that pin, checks the target at its new place.
    check = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from sglang_hisparse import pins
        pins.PATCH_ROOT = Path({str(out)!r}); pins.pin.cache_clear()
        from sglang_hisparse.manifest import ENTRIES, entries_of
        from sglang_hisparse.plugin import check_entry
        (e,) = [e for e in ENTRIES if e.target == {target!r}]
        c = check_entry(e, {installed!r}, Path({str(root)!r}), build=False)
        print(c.ok, c.where, c.detail)
    """)], capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert check.stdout.split() [:2] == ["True", new_place], check.stdout + check.stderr[-2000:]


def test_a_renamed_target_is_offered_on_0_5_17(sglang_0_5_17, sglang_0_5_15_post1):
    # 0.5.17 renamed ModelRunner.max_token_pool_size (model_runner.py:1190):
    # the port from the 0.5.15.post1 pin, repeated (--from), reading the old
    # source from that release's wheel: the installed release would give its
    # own place (0.5.17's pin records the move, offered as "moved?").
    proc = run_rebase(str(sglang_0_5_17), "--from", POST1_15, "--old-root", str(sglang_0_5_15_post1))
    assert proc.returncode == 1
    (line,) = [ln.strip() for ln in proc.stdout.splitlines()
               if ln.strip().startswith("renamed? sglang.srt.model_executor.model_runner."
                                        "ModelRunner.effective_max_total_num_tokens ")]
    assert float(line.split(", ")[-1].split()[0]) > 0.6, line


def test_rebase_reads_the_old_release_from_old_root(sglang_0_5_17, sglang_0_5_15_post1):
    """With --old-root the rebase needs no install of the old release: the
    0.5.15.post1 wheel's sources re-anchor the forward_extend patch on 0.5.17
    and name where 0.5.17 moved the allocation helpers (mem_cache/allocation.py)."""
    proc = run_rebase(str(sglang_0_5_17), "--old-root", str(sglang_0_5_15_post1), "--from", POST1_15)
    assert proc.returncode == 1  # the port needs a person
    assert "  reapply  sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend\n" \
        in proc.stdout
    for fn in ("alloc_paged_token_slots_extend", "alloc_paged_token_slots_decode", "alloc_for_decode"):
        (line,) = [ln.strip() for ln in proc.stdout.splitlines()
                   if ln.strip().startswith(f"moved?   sglang.srt.mem_cache.allocation.{fn} ")]
        assert float(line.split(", ")[-1].split()[0]) > 0.9, line
    assert "nothing written" not in proc.stdout and "wrote " not in proc.stdout


def test_from_names_an_older_pin_or_is_refused(sglang_0_5_17):
    for bad in (V17, "0.5.9"):
        proc = run_rebase(str(sglang_0_5_17), "--from", bad)
        assert proc.returncode == 2
        assert (f"--from takes a pin older than sglang 0.5.17: one of 0.5.13, {POST1}, "
                f"{POST1_15}, got {bad!r}") in proc.stderr
    # Without it: the newest pin before the release (its own, once pinned).
    newest = (POST1_15, V17)[V17 in SUPPORTED_SGLANG_VERSIONS]
    assert run_rebase(str(sglang_0_5_17)).stdout.startswith(
        f"rebasing the {newest} manifest onto sglang {V17}")
