"""DeepSeek-V4 PD with a draft model: the draft's SWA state in the transfer.

Real SGLang pools on CPU, built as the model runner builds them for a
DeepSeek-V4 server with EAGLE/MTP: the target ``DeepSeekV4TokenToKVPool``
with compress ratios [0, 4, 128, 4] (plain, and with HiSparse's C4 pool),
the draft's with [0] (the NextN layer) and no C4/C128/state pools, a real
``SWATokenToKVPoolAllocator`` whose mapping the draft shares (0.5.13
``model_runner_kv_cache_mixin.py:817-826``), and the release's own
``setup_state_kv_args`` filling a real ``KVArgs`` the way both PD sides call
it, followed by our AFTER hook as ``HookRegistry`` runs it.
"""

import json

import pytest
import torch

from conftest import run_python
from dataplane_fixtures import dsa_pool, dsv4_pool, our_c4_pool_as_native
from sglang_hisparse.adapter import releases
from sglang_hisparse.adapter.disaggregation_dsv4 import register_draft_swa_state
from sglang_hisparse.pinned_source import sglang_version

TARGET_RATIOS = [0, 4, 128, 4]
FULL, SWA = 8192, 4096  # tokens
SETUP = "sglang.srt.disaggregation.utils.setup_state_kv_args"


def _native() -> bool:
    from sglang_hisparse.manifest import ENTRIES

    (entry,) = [e for e in ENTRIES if e.target == SETUP]
    return not entry.applies_to(sglang_version())


# From 0.5.16 the release registers the draft's SWA state itself and our hook
# is not installed (its entry ends at 0.5.15.post1): there the tests check the
# release's own registration and refusals.
NATIVE = _native()
NATIVE_REASON = (f"sglang {sglang_version()} registers the draft's SWA state itself "
                 "(native since 0.5.16)")


def target_pool(hisparse=False):
    with our_c4_pool_as_native():
        return dsv4_pool(compression_ratios=TARGET_RATIOS, swa_size=SWA, c4_size=1024,
                         c128_size=FULL // 128, state_pool_size=16, enable_hisparse=hisparse)


def swa_allocator(pool):
    """SGLang's SWA allocator over ``pool``: it registers its full-to-SWA
    mapping in the pool."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(FULL, SWA, page_size=pool.page_size, dtype=torch.uint8,
                                     device="cpu", kvcache=pool, need_sort=False)


def draft_pool(target, **geometry):
    """The draft's pool sharing the target allocator's mapping, as the model
    runner of a draft worker does (it sets the attribute directly)."""
    kw = dict(compression_ratios=[0], swa_size=SWA)
    kw.update(geometry)
    draft = dsv4_pool(**kw)
    draft.full_to_swa_index_mapping = target.full_to_swa_index_mapping
    return draft


def pools(hisparse=False):
    target = target_pool(hisparse)
    swa_allocator(target)
    return target, draft_pool(target)


def kv_args_for(target, draft):
    """``KVArgs`` (what every transfer backend's get_kv_class gives) with the
    KV buffers both PD sides register before the state: the target's and
    the draft's contiguous buffers (an SWA-only draft has none)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    kv_args = KVArgs()
    ptrs, lens, items = target.get_contiguous_buf_infos()
    if draft is not None:
        d_ptrs, d_lens, d_items = draft.get_contiguous_buf_infos()
        ptrs, lens, items = ptrs + d_ptrs, lens + d_lens, items + d_items
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, items
    kv_args.page_size = target.page_size
    return kv_args


def release_setup(target, draft):
    """The release's setup_state_kv_args alone (what 0.5.13 registers)."""
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    kv_args = kv_args_for(target, draft)
    setup_state_kv_args(kv_args, target, draft, total_kv_layers=len(TARGET_RATIOS),
                        req_to_token_pool=None)
    return kv_args


def hooked_setup(target, draft):
    """What a PD side registers: the release's function, then (where the
    release does not do it itself) our hook with its result and arguments,
    as HookRegistry's AFTER wrapper calls it (decode's call: keywords last)."""
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    kv_args = kv_args_for(target, draft)
    kwargs = dict(total_kv_layers=len(TARGET_RATIOS), req_to_token_pool=None)
    result = setup_state_kv_args(kv_args, target, draft, **kwargs)
    if not NATIVE:
        assert register_draft_swa_state(result, kv_args, target, draft, **kwargs) is None
    return kv_args


def components(kv_args):
    return list(zip(kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens,
                    kv_args.state_item_lens, kv_args.state_dim_per_tensor))


def swa_buffers(pool):
    bufs = pool.swa_kv_pool.kv_buffer
    return ([b.data_ptr() for b in bufs], [b.nbytes for b in bufs], [b[0].nbytes for b in bufs])


def every_registered_ptr(kv_args):
    return set(kv_args.kv_data_ptrs).union(*kv_args.state_data_ptrs)


# ------------------------------------------------------------ the release alone
def test_the_release_leaves_the_draft_swa_state_out():
    """What the hook fixes: without it the draft's SWA buffers are in no
    component and no KV buffer, so nothing sends them."""
    target, draft = pools()
    kv_args = release_setup(target, draft)
    assert kv_args.state_types[0] == "swa"
    assert len(kv_args.state_data_ptrs[0]) >= len(TARGET_RATIOS)  # the target's SWA layers first
    registered = set(swa_buffers(draft)[0]) & every_registered_ptr(kv_args)
    # From 0.5.16 the release sends them itself.
    assert registered if NATIVE else not registered


# ------------------------------------------------------------ with the hook
@pytest.mark.parametrize("hisparse", [False, True], ids=["plain", "hisparse"])
def test_the_draft_swa_buffers_are_a_component_of_their_own(hisparse):
    target, draft = pools(hisparse)
    release = components(release_setup(target, None))  # the target's own components
    kv_args = hooked_setup(target, draft)
    got = components(kv_args)
    # The release's components come first, untouched; then exactly one more.
    assert got[:-1] == release and len(got) == len(release) + 1
    state_type, ptrs, lens, item_lens, dims = got[-1]
    assert state_type == "swa" and dims == []
    assert (ptrs, lens, item_lens) == swa_buffers(draft)
    assert len(ptrs) == 1  # the NextN layer
    # Not mixed with the target's: no draft buffer there, no target buffer here.
    target_ptrs = set().union(*(c[1] for c in release))
    assert not set(ptrs) & target_ptrs
    assert set(swa_buffers(target)[0]) <= target_ptrs
    # The draft's rows are pages of the target's SWA geometry.
    assert lens[0] == item_lens[0] * (SWA // target.swa_page_size + 1)


def test_without_a_draft_or_with_other_pools_nothing_changes():
    target, _ = pools()
    assert components(hooked_setup(target, None)) == components(release_setup(target, None))
    # A DSA target and draft (DeepSeek-V3.2 MTP): the release's DSA component.
    dsa, dsa_draft = dsa_pool(), dsa_pool(layers=1)
    assert components(hooked_setup(dsa, dsa_draft)) == components(release_setup(dsa, dsa_draft))
    # A DeepSeek-V4 target with a draft of another kind.
    assert components(hooked_setup(target, dsa_draft)) == components(
        release_setup(target, dsa_draft))


# ------------------------------------------------------------ mismatches
def _not_swa_only(target):
    draft = dsv4_pool(compression_ratios=[4], swa_size=SWA, c4_size=1024,
                      c128_size=FULL // 128, state_pool_size=16)
    draft.full_to_swa_index_mapping = target.full_to_swa_index_mapping
    return draft


def _own_mapping(target):
    draft = dsv4_pool(compression_ratios=[0], swa_size=SWA)
    swa_allocator(draft)  # a mapping of its own
    return draft


# (the draft, our message, the native release's message: None where it does
# not compare that, 0.5.17 disaggregation/utils.py:1135-1190)
MISMATCHES = {
    "not-swa-only": (_not_swa_only,
                     "the draft's layers are not SWA-only: compress ratios [4]",
                     "DSV4 draft state transfer expects SWA-only NextN layers"),
    "mapping": (_own_mapping, "full-to-SWA index mapping: the draft does not share the target's",
                "DSV4 target and draft pools must share the SWA index mapping"),
    "swa-size": (lambda t: draft_pool(t, swa_size=SWA // 2),
                 f"page geometry: swa_size target {SWA}, draft {SWA // 2}", None),
    "swa-page": (lambda t: draft_pool(t, swa_page_size=128),
                 "page geometry: swa_page_size target 256, draft 128", None),
    "page": (lambda t: draft_pool(t, page_size=512),
             "page geometry: page_size target 256, draft 512",
             "DSV4 target and draft pools must share paged SWA geometry: "
             "target=(256, 128), draft=(512, 128)"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_each_mismatch_is_refused_naming_what_differs(case):
    make, message, native_message = MISMATCHES[case]
    if NATIVE and native_message is None:
        pytest.skip(f"{NATIVE_REASON}, and does not compare this ({case})")
    target = target_pool()
    swa_allocator(target)
    draft = make(target)
    with pytest.raises(RuntimeError) as err:
        hooked_setup(target, draft)
    text = str(err.value)
    if NATIVE:
        assert text == native_message
        return
    assert text.startswith("DeepSeek-V4 PD transfer of the draft's SWA state")
    assert message in text
    assert text.count(";") == 0, text  # this one difference only


@pytest.mark.skipif(NATIVE, reason=NATIVE_REASON)
def test_a_different_kv_mode_is_refused(monkeypatch):
    """0.5.13 has paged KV only; the release module reports each pool's mode,
    so the check is driven through it (0.5.15's unified KV is HIP-only)."""
    target, draft = pools()
    monkeypatch.setattr(releases.current, "dsv4_kv_mode",
                        lambda pool: "unified" if pool is draft else "paged")
    with pytest.raises(RuntimeError, match="KV mode: target paged, draft unified"):
        hooked_setup(target, draft)


@pytest.mark.skipif(NATIVE, reason=NATIVE_REASON + " (one difference at a time)")
def test_every_difference_is_named_at_once():
    target = target_pool()
    swa_allocator(target)
    draft = dsv4_pool(compression_ratios=[0, 0], swa_size=SWA // 2, swa_page_size=128)
    with pytest.raises(RuntimeError) as err:
        hooked_setup(target, draft)
    text = str(err.value)
    for part in ("full-to-SWA index mapping", "swa_page_size target 256, draft 128",
                 f"swa_size target {SWA}, draft {SWA // 2}"):
        assert part in text
    assert "SWA-only" not in text  # two NextN layers are still SWA-only


@pytest.mark.skipif(NATIVE, reason=NATIVE_REASON)
def test_unified_kv_on_both_sides_is_left_as_the_release_has_it(monkeypatch):
    target, draft = pools()
    monkeypatch.setattr(releases.current, "dsv4_kv_mode", lambda pool: "unified")
    assert components(hooked_setup(target, draft)) == components(release_setup(target, draft))


# ------------------------------------------------------------ the plugin
def test_the_plugin_reaches_both_pd_sides():
    """Activated, the hook is what decode.py and prefill.py call (they import
    setup_state_kv_args by name; HookRegistry rebinds those names)."""
    proc = run_python(
        """
        import json, sys
        sys.path.insert(0, "tests")
        import sglang.srt.disaggregation.decode as decode    # imported before activation
        from sglang_hisparse.plugin import activate
        act = activate()
        import sglang.srt.disaggregation.prefill as prefill
        import sglang.srt.disaggregation.utils as utils
        from test_dsv4_draft_swa import kv_args_for, pools, swa_buffers
        target, draft = pools()
        out = {}
        for side, fn in (("decode", decode.setup_state_kv_args),
                         ("prefill", prefill.setup_state_kv_args)):
            kv_args = kv_args_for(target, draft)
            fn(kv_args, target, draft, 4, req_to_token_pool=None)
            out[side] = [list(kv_args.state_types), kv_args.state_data_ptrs[-1]]
        print(json.dumps(dict(
            applied=act.applied, error=act.error,
            same=decode.setup_state_kv_args is prefill.setup_state_kv_args
                 is utils.setup_state_kv_args,
            draft=swa_buffers(draft)[0], **out)))
        """
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["applied"], res["error"]
    assert res["same"]
    for side in ("decode", "prefill"):
        types, last_ptrs = res[side]
        assert types[-1] == "swa" and types.count("swa") == 2, (side, types)
        assert last_ptrs == res["draft"], side


def test_manifest_entry_checks_out():
    from sglang_hisparse.manifest import ENTRIES, Kind, Scope
    from sglang_hisparse.pinned_source import sglang_version
    from sglang_hisparse.plugin import check_entry

    (entry,) = [e for e in ENTRIES if e.target == SETUP]
    assert entry.kind is Kind.AFTER and entry.scope is Scope.ALWAYS
    assert entry.native_in == "0.5.16" and not entry.applies_to("0.5.16")
    assert entry.applies_to(sglang_version()) is not NATIVE
    if not NATIVE:  # (a release past the entry has no hash for it)
        check = check_entry(entry, sglang_version())
        assert check.ok, check.detail
        assert check.hook is register_draft_swa_state
    relying = [e.target for e in ENTRIES if e.kind is Kind.DEPENDS and any(
        r.endswith(":register_draft_swa_state") for r in e.relied_on_by)]
    assert "sglang.srt.disaggregation.utils.append_state_component" in relying
    for target in relying:
        (dep,) = [e for e in ENTRIES if e.kind is Kind.DEPENDS and e.target == target]
        assert dep.scope is Scope.ALWAYS, target  # checked whenever the hook is installed
