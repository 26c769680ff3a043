"""The manifest as data: well-formed entries, DEPENDS pinned on the real 0.5.13,
and what a changed dependency does to the loader, the doctor and the rebase.

A changed SGLang is an *overlay* of the installed 0.5.13: a directory whose
files are symlinks to the real install except the one file the test edits
(pinned_source reads any root; nothing is imported from the overlay).
"""

import ast
import importlib
import io
import json
import re
from pathlib import Path

import pytest

from conftest import REPO, run_python, run_rebase
from releases import overlay_release
from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS, pins
from sglang_hisparse.manifest import DEPENDS, ENTRIES, HOOKS, Kind, Process, entries_of
from sglang_hisparse.pinned_source import installed_sglang_root, read_pinned_source, sglang_version
from sglang_hisparse.plugin import check_entry

PIN = sglang_version()  # the installed release: CI runs the suite on each pin
# A DEPENDS target and a line of it our code relies on (the resume order
# RetainOnRetract serves: _pre_alloc, then load_kv_cache).
RESUME = "sglang.srt.disaggregation.decode.DecodePreallocQueue.resume_retracted_reqs"
RESUME_ORDER = "            self._pre_alloc(req)\n"


def overlay_root(tmp_path: Path, target: str, old: str, new: str) -> Path:
    """A copy of the installed SGLang (symlinks) whose ``target`` source has
    ``old`` replaced by ``new``."""
    path = read_pinned_source(target).path
    text = path.read_text()
    assert old in text
    rel = path.relative_to(installed_sglang_root())
    return overlay_release(tmp_path, {str(rel): text.replace(old, new, 1)})


@pytest.fixture(scope="module")
def changed_resume(tmp_path_factory):
    """0.5.13 with resume_retracted_reqs no longer preallocating before it
    loads the KV (the order our retention relies on)."""
    return overlay_root(
        tmp_path_factory.mktemp("changed"), RESUME, RESUME_ORDER,
        "            pass\n",
    )


def _resolve(ref: str):
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for name in qualname.split(".") if qualname else ():
        obj = getattr(obj, name)
    return obj


# ------------------------------------------------------------ the data
def test_every_target_is_listed_once_per_release():
    # A target may come back over releases its first entry does not cover
    # (patched up to one release, relied on unchanged from the next).
    for version in pins.supported_versions():
        targets = [e.target for e in ENTRIES if e.applies_to(version)]
        assert len(targets) == len(set(targets)), version
    assert ENTRIES == HOOKS + DEPENDS
    assert all(e.kind.installs for e in HOOKS) and not any(e.kind.installs for e in DEPENDS)


def test_every_entry_names_the_process_that_runs_it():
    assert all(isinstance(e.process, Process) for e in ENTRIES)
    by_target = {e.target.rsplit(".", 1)[1]: e.process for e in ENTRIES}
    # ServerArgs runs its checks in the launcher only; the pools and the model
    # runner read the config in every scheduler process.
    assert by_target["validate_hisparse"] is Process.LAUNCHER
    assert by_target["apply_hisparse_dsa_backend_defaults"] is Process.LAUNCHER
    assert by_target["parse_hisparse_config"] is Process.SCHEDULER
    assert by_target["check_server_args"] is Process.LAUNCHER
    assert by_target["load_plugins"] is Process.BOTH
    assert by_target["HiSparseCoordinator"] is Process.SCHEDULER


def test_every_depends_entry_is_hash_only_and_says_what_relies_on_it():
    for e in DEPENDS:
        assert e.impl is None and e.kind is Kind.DEPENDS, e.target
        assert e.relied_on_by, e.target
        assert e.why and "\n" not in e.why and len(e.why) < 200, e.target
        assert set(e.sha256) == {v for v in SUPPORTED_SGLANG_VERSIONS if e.applies_to(v)}, e.target


def test_impls_and_relied_on_by_resolve_in_our_package():
    for e in HOOKS:
        if e.impl:
            assert _resolve(e.impl) is not None, e.impl
    for e in DEPENDS:
        for ref in e.relied_on_by:
            assert ref.startswith("sglang_hisparse.") and ":" in ref, ref
            _resolve(ref)


def test_tests_fields_name_existing_modules():
    for e in ENTRIES:
        for t in e.tests:
            assert (REPO / t).is_file() and t.startswith("tests/test_"), (e.target, t)
    assert all(e.tests for e in HOOKS)


def test_every_replace_lists_its_behaviour():
    for e in ENTRIES:
        if e.kind is Kind.REPLACE:
            assert e.behaviour and all(line.strip() for line in e.behaviour), e.target
        elif e.kind is Kind.DEPENDS:
            assert not e.behaviour, e.target
    (coord,) = [e for e in ENTRIES if e.target.endswith("hisparse_coordinator.HiSparseCoordinator")]
    text = " ".join(coord.behaviour).lower()
    assert "residen" in text and "demot" in text
    assert "parking" in text or "parked" in text
    assert "retract" in text
    assert "realrequestcount" in text and "num_real_reqs" in text
    assert coord.impl == "sglang_hisparse.adapter.model_runner:HiSparseCoordinator"
    (prop,) = [e for e in ENTRIES if e.kind is Kind.PROPERTY]
    assert prop.impl == "sglang_hisparse.adapter.model_runner:model_runner_max_token_pool_size"


# ------------------------------------------------------------ against 0.5.13
def test_every_depends_hash_matches_the_installed_pin():
    for e in entries_of(PIN, DEPENDS):
        check = check_entry(e, PIN)
        assert check.ok, (e.target, check.detail)
        assert check.hook is None


# What marks a function as one that calls into our data plane: a member of
# the coordinator, a local bound to it, or an attribute only our allocator
# and pools have.
_CALLS_IN = re.compile(
    r"hisparse_coordinator\.\w"
    r"|^\s*\w+\s*=\s*[\w.]*hisparse_coordinator\s*$"
    r"|\.(alloc_logical_only|hisparse_attn_allocator|logical_attn_allocator|hisparse_page_size"
    r"|translate_loc_to_hisparse_device|translate_loc_from_full_to_hisparse_device)\b",
    re.M,
)


def _functions_calling_in(root: Path) -> dict[str, str]:
    found = {}
    for path in sorted((root / "sglang" / "srt").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "hisparse" not in text or path.name == "hisparse_coordinator.py":
            continue
        lines = text.splitlines(keepends=True)
        module = ".".join(path.relative_to(root).with_suffix("").parts)

        def walk(body, prefix):
            for node in body:
                if isinstance(node, ast.ClassDef):
                    walk(node.body, prefix + [node.name])
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    if _CALLS_IN.search("".join(lines[first - 1 : node.end_lineno])):
                        found[".".join([module, *prefix, node.name])] = f"{path.name}:{first}"

        walk(ast.parse(text).body, [])
    return found


def test_every_0_5_13_function_that_calls_into_our_data_plane_is_an_entry():
    # (where the installed release keeps each target: its pin records moves)
    targets = {pins.release_target(e.target, sglang_version()) for e in ENTRIES}
    found = _functions_calling_in(installed_sglang_root())
    # Methods of a class we replace are ours at runtime.
    missing = {
        fn: where for fn, where in found.items()
        if fn not in targets and not any(fn.startswith(t + ".") for t in targets)
    }
    assert not missing, missing
    assert len(found) > 20


# ------------------------------------------------------------ a changed dependency
def test_changed_depends_target_fails_its_check(changed_resume):
    (entry,) = [e for e in DEPENDS if e.target == RESUME]
    check = check_entry(entry, PIN, changed_resume, build=False)
    assert not check.ok and "source changed" in check.detail
    # The rest of the overlay is the pin.
    other = next(e for e in DEPENDS if e.target.endswith("_allocatable_token_budgets"))
    assert check_entry(other, PIN, changed_resume, build=False).ok


def test_activation_refuses_a_release_whose_dependency_changed(changed_resume):
    proc = run_python(
        f"""
        import json, pathlib
        import sglang_hisparse.pinned_source as ps
        ps.installed_sglang_root = lambda: pathlib.Path({str(changed_resume)!r})
        from sglang_hisparse.plugin import activate
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.managers.scheduler import Scheduler
        before = dict(Scheduler.__dict__)
        act = activate()
        print(json.dumps(dict(
            applied=act.applied, error=act.error,
            failed=[c.entry.target for c in act.checks if not c.ok],
            hooks=len(HookRegistry._hooks),
            untouched=all(Scheduler.__dict__.get(k) is v for k, v in before.items()))))
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not res["applied"] and res["failed"] == [RESUME]
    assert RESUME in res["error"] and "source changed" in res["error"]
    assert "nothing was patched" in res["error"]
    assert res["hooks"] == 0 and res["untouched"]
    assert f"sglang-hisparse not activated: 1 manifest entry failed on sglang {PIN}" in proc.stderr


def test_doctor_lists_every_dependency():
    from sglang_hisparse.doctor import run_doctor

    out = io.StringIO()
    assert run_doctor(None, out=out) == 0
    text = out.getvalue()
    # (the installed release's: an entry a later release added is not listed)
    depends, entries = entries_of(PIN, DEPENDS), entries_of(PIN)
    hooks = entries_of(PIN, HOOKS)
    for e in depends:
        assert f"OK   DEPENDS      {e.process.value:<9} {e.target}\n" in text, e.target
    assert text.count("impl      hash only; relied on by") == len(depends)
    assert (
        f"{len(entries)} of {len(entries)} entries OK ({len(hooks)} of {len(hooks)} hooks, "
        f"{len(depends)} of {len(depends)} dependencies)"
    ) in text


def test_doctor_verbose_prints_behaviour_lines():
    from sglang_hisparse.doctor import run_doctor

    out = io.StringIO()
    run_doctor(None, out=out, verbose=True)
    text = " ".join(out.getvalue().split())
    for e in entries_of(sglang_version()):  # doctor shows the installed release's entries
        for line in e.behaviour:
            assert f"behaviour {line}" in text, line
    plain = io.StringIO()
    run_doctor(None, out=plain)
    assert "behaviour" not in plain.getvalue()


def test_doctor_names_a_changed_dependency(changed_resume):
    from sglang_hisparse.doctor import run_doctor

    out = io.StringIO()
    assert run_doctor(changed_resume, out=out) == 1
    lines = out.getvalue().splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith("  FAIL")]
    assert lines[i] == f"  FAIL DEPENDS      scheduler {RESUME}"
    assert lines[i + 1].strip().startswith("-> source changed")
    assert "engine.policies.retain_on_retract:RetainOnRetract.restore_retained" in " ".join(
        lines[i + 2 : i + 5])


def _rebase(*args):
    return run_rebase(*args, timeout=300)


def test_rebase_sends_a_changed_dependency_to_a_person(changed_resume):
    proc = _rebase(str(changed_resume))  # DIR, as DEVELOPERS.md runs it
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout
    lines = out.splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith(f"  changed  {RESUME} (decode.py:")]
    (entry,) = [e for e in DEPENDS if e.target == RESUME]
    assert [line.strip() for line in lines[i + 1 : i + 1 + len(entry.relied_on_by)]] == [
        f"relied on by {who}" for who in entry.relied_on_by]
    for e in entries_of(PIN):
        if e.target != RESUME:
            assert f"  same     {e.target}\n" in out, e.target
    assert "1 entry needs a human" in out
    same = _rebase("--sglang-root", str(changed_resume))
    assert same.stdout == out


def test_rebase_takes_a_dependency_a_person_accepted(changed_resume, tmp_path):
    proc = _rebase(str(changed_resume), "--write", "--accept", RESUME, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"  accepted {RESUME} (decode.py:" in proc.stdout
    (pin,) = tmp_path.glob("sglang-*/pin.json")
    written = json.loads(pin.read_text())["sha256"]
    assert written[RESUME] == read_pinned_source(RESUME, changed_resume).sha256
    assert written[RESUME] != read_pinned_source(RESUME).sha256
    assert {e.target for e in entries_of(PIN)} == set(written)


def test_rebase_hash_is_the_loaders_hash():
    targets = [e.target for e in DEPENDS[:3]]
    proc = _rebase("--hash", *targets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line, target in zip(proc.stdout.splitlines(), targets):
        name, digest, where = line.split()
        assert name == target and digest == read_pinned_source(target).sha256
    assert _rebase().returncode == 2  # no release directory
