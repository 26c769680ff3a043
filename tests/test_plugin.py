"""The loader: entry point, idempotence, SGLANG_PLUGINS, all-or-nothing activation.

Activation mutates SGLang process-wide, so every activation runs in a fresh
interpreter and reports back as JSON on its last output line.
"""

import json

from conftest import run_python
from sglang_hisparse.pinned_source import sglang_version

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
        from sglang.srt.plugins.hook_registry import HookRegistry
        print(json.dumps(dict(
            applied=act.applied,
            version=act.version,
            changed=first is not original[0],
            stable=first is second,
            wraps_original=getattr(first, "__wrapped__", None) is original[0],
            registered=sorted(HookRegistry._hooks),
            depends_hooks=[c.hook for c in act.checks if c.entry.kind.value == "DEPENDS"],
        )))
        """
    )
    res = _last_json(proc)
    assert res["applied"] and res["version"] == sglang_version()
    assert res["changed"] and res["stable"] and res["wraps_original"], res
    # Every hook of this mode is registered with SGLang (beside other
    # installed plugins' hooks), none of the native comparison's; DEPENDS
    # entries install nothing.
    from sglang_hisparse.manifest import DEPENDS, HOOKS, Kind, Scope, entries_of

    from sglang_hisparse import pins

    # (where the installed release keeps each target: its pin records moves;
    # only the hooks the release has: ``since``/``until``)
    ours = {pins.release_target(e.target, sglang_version())
            for e in entries_of(sglang_version(), HOOKS)
            if e.kind is not Kind.PROPERTY and e.scope is not Scope.NATIVE}
    assert ours <= set(res["registered"])
    assert not {e.target for e in HOOKS if e.scope is Scope.NATIVE} & set(res["registered"])
    # (every dependency the installed release has: ``since`` leaves out later
    # seams, and a target patched here is relied on unchanged only later)
    here = [e for e in DEPENDS if e.applies_to(sglang_version())]
    assert not {e.target for e in here} & set(res["registered"])
    assert len(res["depends_hooks"]) == len(here) and not any(res["depends_hooks"])


def test_patched_decode_batch_sets_cpu_indices():
    proc = run_python(
        """
        import json
        from sglang_hisparse.plugin import activate
        act = activate()
        hook = next(c.hook for c in act.checks if c.entry.target == %r)
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


def test_patched_decode_batch_sets_cpu_indices_and_asks_only_requested_logprobs():
    # The real patched function on real pools, Reqs and FutureMap; only the
    # Scheduler (which needs a GPU to build) is a namespace of its attributes.
    proc = run_python(
        """
        import json, sys, types
        sys.path.insert(0, "tests")
        import torch
        from sglang_hisparse.plugin import activate
        assert activate().applied
        from array import array
        from dataplane_fixtures import dsa_pool, prefill, req_pool
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams
        import sglang.srt.server_args as sa
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.overlap_utils import FutureMap
        from releases import installed_object
        HiSparseTokenToKVPoolAllocator = installed_object(
            "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseTokenToKVPoolAllocator")
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        sa.set_global_server_args_for_scheduler(sa.ServerArgs(model_path="dummy"))
        pool, r2t = dsa_pool(1024), req_pool(8, 2048)
        alloc = HiSparseTokenToKVPoolAllocator(1024, 64, torch.bfloat16, "cpu", pool, False, 2)
        reqs = []
        asked = ([5, 9], None)  # token_ids_logprob of each request
        for i, n in enumerate((300, 70)):
            r = Req(f"r{i}", "", array("i", range(3, 3 + n)), SamplingParams(max_new_tokens=16),
                    return_logprob=True, top_logprobs_num=2, token_ids_logprob=asked[i])
            prefill(r2t, alloc, r, n)
            r.output_ids = [7]
            reqs.append(r)
        spec = SpeculativeAlgorithm.NONE
        sched = types.SimpleNamespace(
            device="cpu", req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
            tree_cache=None, enable_overlap=False, spec_algorithm=spec,
            model_config=types.SimpleNamespace(vocab_size=1024, is_encoder_decoder=False),
            future_map=FutureMap(torch.device("cpu"), spec, r2t))
        patched = Scheduler._build_hisparse_decode_batch
        fixed = patched(sched, reqs)
        stock = patched.__wrapped__(sched, reqs)
        print(json.dumps(dict(
            fixed=fixed.req_pool_indices_cpu.tolist(),
            device=fixed.req_pool_indices.tolist(),
            stock=None if stock.req_pool_indices_cpu is None else "set",
            fixed_ids=fixed.token_ids_logprobs, fixed_top=fixed.top_logprobs_nums,
            stock_id_counts=[len(x) for x in stock.token_ids_logprobs])))
        """
    )
    res = _last_json(proc)
    # Where the release's patch adds the CPU indices (0.5.13 and .post1), the
    # stock batch leaves them None for the eager backup to index; from 0.5.15
    # the release sets them itself and its patch keeps only the logprob hunk.
    from sglang_hisparse.source_patch import patch_file

    patch = patch_file(sglang_version(), TARGET).read_text()
    adds_cpu_indices = "+        batch.req_pool_indices_cpu" in patch
    assert (res["stock"] is None) is adds_cpu_indices
    assert res["fixed"] == res["device"] == [1, 2]
    # 0.5.13 asks every decode step for the logprob of each prompt token id.
    assert res["stock_id_counts"] == [300, 70]
    assert res["fixed_ids"] == [[5, 9], None]
    assert res["fixed_top"] == [2, 2]


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
from sglang_hisparse.manifest import ENTRIES, Entry, Kind, Process
from sglang_hisparse.plugin import activate
from sglang_hisparse.pinned_source import read_pinned_source, sglang_version
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
V = sglang_version()  # the installed pin
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
    kind=Kind.AFTER, sha256={V: "0" * 64}, why="test", native_in=None,
    process=Process.SCHEDULER, impl="builtins:print")
act = activate(entries=(good, bad_hash))
results["bad_hash"] = dict(applied=act.applied, error=act.error, untouched=untouched())

tmp = pathlib.Path(tempfile.mkdtemp())
(tmp / f"sglang-{V}").mkdir()
diff = source_patch.patch_file(V, TARGET).read_text()
# The patch's first context line, changed: a hunk the pinned source does not hold.
lines = diff.splitlines(keepends=True)
first_context = next(i for i, line in enumerate(lines) if line.startswith(" ") and line.strip())
lines[first_context] = lines[first_context].rstrip("\\n") + "  # not in the source\\n"
(tmp / f"sglang-{V}" / f"{TARGET}.diff").write_text("".join(lines))
real_root = source_patch.PATCH_ROOT
source_patch.PATCH_ROOT = tmp
act = activate(entries=(good,))
source_patch.PATCH_ROOT = real_root
results["stale_hunk"] = dict(applied=act.applied, error=act.error, untouched=untouched())

# A hook that SGLang's HookRegistry itself refuses while applying (AFTER on a
# class): the entry before it had already been applied and must be rolled back.
cls_target = "sglang.srt.managers.scheduler.Scheduler"
bad_kind = Entry(target=cls_target, kind=Kind.AFTER,
                 sha256={V: read_pinned_source(cls_target).sha256},
                 why="test", native_in=None, process=Process.SCHEDULER, impl="builtins:print")
act = activate(entries=(good, bad_kind))
results["rollback"] = dict(applied=act.applied, error=act.error, untouched=untouched())

# Another plugin's hook already applied on a target of ours: 0.5.13's
# apply_hooks skips the target, so ours is registered but never installed.
# That is a refusal too, and the other plugin's hook stays as it was.
other_target = TARGET.rsplit(".", 1)[0] + ".get_next_batch_to_run"
def theirs(original, *args, **kwargs):
    return original(*args, **kwargs)
HookRegistry.register(other_target, theirs, HookType.AROUND)
HookRegistry.apply_hooks()
their_wrapper = Scheduler.__dict__["get_next_batch_to_run"]
ours = next(e for e in ENTRIES if e.target == other_target)
act = activate(entries=(good, ours))
results["skipped"] = dict(
    applied=act.applied, error=act.error,
    untouched=(Scheduler.__dict__["get_next_batch_to_run"] is their_wrapper
               and [h[1] for h in HookRegistry._hooks[other_target]] == [theirs]
               and other_target in HookRegistry._patched
               and Scheduler.__dict__[TARGET.rsplit(".", 1)[1]] is snapshot[TARGET.rsplit(".", 1)[1]]
               and TARGET not in HookRegistry._hooks))
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

    assert not res["skipped"]["applied"]
    assert "rolled back" in res["skipped"]["error"] and "get_next_batch_to_run" in res["skipped"]["error"]
    for case in res.values():
        assert case["untouched"], case


def _code_names(path):
    """Imported modules and names used in code (not docstrings) of one file."""
    import ast

    tree = ast.parse(path.read_text())
    imported, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return imported, names


def test_only_the_adapter_installs_through_sglangs_hook_registry():
    from conftest import REPO

    pkg = REPO / "sglang_hisparse"
    imported, _ = _code_names(pkg / "plugin.py")
    assert not any(m == "sglang" or m.startswith("sglang.") for m in imported), imported
    users = sorted(
        str(path.relative_to(pkg))
        for path in pkg.rglob("*.py")
        if {"HookRegistry", "HookType"} & _code_names(path)[1]
        or any("hook_registry" in m and m.startswith("sglang.") for m in _code_names(path)[0])
    )
    assert users == ["adapter/hook_registry.py"], users
