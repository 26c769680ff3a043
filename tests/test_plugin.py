"""The loader: entry point, idempotence, SGLANG_PLUGINS, all-or-nothing activation.

Activation mutates SGLang process-wide, so every activation runs in a fresh
interpreter and reports back as JSON on its last output line.
"""

import json

from conftest import run_python

TARGET = "sglang.srt.managers.scheduler.Scheduler._build_hisparse_decode_batch"


def _last_json(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("sglang_hisparse") == "sglang_hisparse.plugin:register"


def test_load_plugins_activates_once_and_is_idempotent():
    proc = run_python(
        f"""
        import json
        from sglang.srt.plugins import load_plugins
        from sglang.srt.managers.scheduler import Scheduler
        # Held in a list: HookRegistry rebinds module globals that are the original.
        original = [Scheduler.__dict__["_build_hisparse_decode_batch"]]
        load_plugins()
        import sglang_hisparse.plugin as plugin
        first = Scheduler.__dict__["_build_hisparse_decode_batch"]
        plugin.register()          # a second call (e.g. Engine.__init__) is a no-op
        load_plugins()
        second = Scheduler.__dict__["_build_hisparse_decode_batch"]
        act = plugin.current_activation()
        print(json.dumps(dict(
            applied=act.applied,
            version=act.version,
            changed=first is not original[0],
            stable=first is second,
            wraps_original=getattr(first, "__wrapped__", None) is original[0],
        )))
        """
    )
    res = _last_json(proc)
    assert res["applied"] and res["version"] == "0.5.13"
    assert res["changed"] and res["stable"] and res["wraps_original"], res


def test_patched_decode_batch_sets_cpu_indices():
    proc = run_python(
        """
        import json
        from sglang_hisparse.plugin import activate
        act = activate()
        from sglang.srt.plugins.hook_registry import HookRegistry
        hook = HookRegistry._hooks[%r][0][1]
        print(json.dumps(dict(applied=act.applied,
                              names=list(hook.__code__.co_names),
                              qualname=hook.__qualname__, module=hook.__module__)))
        """
        % TARGET
    )
    res = _last_json(proc)
    assert res["applied"]
    assert "req_pool_indices_cpu" in res["names"]
    assert res["qualname"] == "Scheduler._build_hisparse_decode_batch"
    assert res["module"] == "sglang.srt.managers.scheduler"


def test_sglang_plugins_whitelist_without_us_skips_us():
    proc = run_python(
        """
        import json
        from sglang.srt.plugins import load_plugins
        from sglang.srt.managers.scheduler import Scheduler
        original = [Scheduler.__dict__["_build_hisparse_decode_batch"]]
        load_plugins()
        import sglang_hisparse.plugin as plugin
        print(json.dumps(dict(
            activation=plugin.current_activation() is not None,
            untouched=Scheduler.__dict__["_build_hisparse_decode_batch"] is original[0],
        )))
        """,
        env={"SGLANG_PLUGINS": "some_other_plugin"},
    )
    res = _last_json(proc)
    assert res == {"activation": False, "untouched": True}


# One interpreter checks every refusal path; each case starts from a clean
# registry and asserts that SGLang is exactly as before.
_REFUSALS = """
import json, pathlib, tempfile, dataclasses
import sglang_hisparse.source_patch as source_patch
from sglang_hisparse.manifest import ENTRIES, Entry, Kind
from sglang_hisparse.plugin import activate
from sglang_hisparse.pinned_source import read_pinned_source
from sglang.srt.plugins.hook_registry import HookRegistry
import sglang.srt.managers.scheduler as sched_mod
from sglang.srt.managers.scheduler import Scheduler

TARGET = %(target)r
good = next(e for e in ENTRIES if e.target == TARGET)
snapshot = dict(Scheduler.__dict__)
mod_snapshot = dict(vars(sched_mod))

def untouched():
    same_cls = all(Scheduler.__dict__.get(k) is v for k, v in snapshot.items())
    same_mod = all(vars(sched_mod).get(k) is v for k, v in mod_snapshot.items())
    return same_cls and same_mod and not HookRegistry._hooks and not HookRegistry._patched

results = {}

act = activate(version="0.5.15")
results["unsupported"] = dict(applied=act.applied, error=act.error, untouched=untouched())

bad_hash = Entry(
    target="sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
    kind=Kind.AFTER, sha256={"0.5.13": "0" * 64}, why="test", native_in=None,
    impl="builtins:print")
act = activate(entries=(good, bad_hash))
results["bad_hash"] = dict(applied=act.applied, error=act.error, untouched=untouched())

tmp = pathlib.Path(tempfile.mkdtemp())
(tmp / "sglang-0.5.13").mkdir()
diff = source_patch.patch_file("0.5.13", TARGET).read_text()
(tmp / "sglang-0.5.13" / f"{TARGET}.diff").write_text(
    diff.replace("batch.req_pool_indices = torch.tensor(", "batch.req_pool_idx = torch.tensor("))
real_root = source_patch.PATCH_ROOT
source_patch.PATCH_ROOT = tmp
act = activate(entries=(good,))
source_patch.PATCH_ROOT = real_root
results["stale_hunk"] = dict(applied=act.applied, error=act.error, untouched=untouched())

# A hook that SGLang's HookRegistry itself refuses while applying (AFTER on a
# class): the entry before it had already been applied and must be rolled back.
cls_target = "sglang.srt.managers.scheduler.Scheduler"
bad_kind = Entry(target=cls_target, kind=Kind.AFTER,
                 sha256={"0.5.13": read_pinned_source(cls_target).sha256},
                 why="test", native_in=None, impl="builtins:print")
act = activate(entries=(good, bad_kind))
results["rollback"] = dict(applied=act.applied, error=act.error, untouched=untouched())
print(json.dumps(results))
"""


def test_refusals_leave_sglang_untouched():
    res = _last_json(run_python(_REFUSALS % {"target": TARGET}))
    assert not res["unsupported"]["applied"]
    assert "0.5.15" in res["unsupported"]["error"] and "not supported" in res["unsupported"]["error"]

    assert not res["bad_hash"]["applied"]
    assert "get_next_batch_to_run" in res["bad_hash"]["error"]
    assert "source changed" in res["bad_hash"]["error"]

    assert not res["stale_hunk"]["applied"]
    assert "_build_hisparse_decode_batch" in res["stale_hunk"]["error"]
    assert "does not apply" in res["stale_hunk"]["error"]

    assert not res["rollback"]["applied"]
    assert "rolled back" in res["rollback"]["error"]
    for case in res.values():
        assert case["untouched"], case
