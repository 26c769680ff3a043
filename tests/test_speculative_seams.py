"""The SGLang seams of a speculative verify step (adapter/speculative.py and
the two source patches), on real 0.5.13 classes where they build on a CPU.

* a whole step through the hooks on a real ScheduleBatch: 0.5.13's own spec
  reserve, ``prepare_for_v2_verify``'s AFTER hook mapping the verify slots
  from the device ``seq_lens``, the "forward" writing through the mapping,
  the union swap-in reading every verify row, ``sample``'s AFTER hook
  writing the rows through and unmapping them;
* the indexer metadata of a verify step keeps token positions;
* the draft runner builds no coordinator and a pool over the logical ids;
* the joining batch (``_build_hisparse_decode_batch``, patched) carries the
  draft state its prefill stashed in the FutureMap, through a merge with
  the running batch, and SGLang's own resolve gathers it.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from conftest import run_python
from dataplane_fixtures import decode_batch, get_tag, put_tag, speculative_server_args, t64, verify_locs
from test_coordinator import Env
from test_verify_step import N, check_verify_reads, needs_spec_reserve_seam

pytestmark = needs_spec_reserve_seam


def test_a_verify_step_through_the_hooks_reads_and_writes_back_exactly():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.eagle_info_v2 import EagleDraftInputV2Mixin

    from sglang_hisparse.adapter import speculative as seams

    env = Env(phys=2048, draft_tokens=N)
    gen = random.Random(3)
    # long, short, and one whose verify rows cross the buffer's end (B = 128)
    reqs = [env.staged("long", 300), env.staged("short", 40), env.staged("edge", 126)]
    env.coord.collect_ready_reqs()
    committed = [300, 40, 126]
    for step in range(6):
        batch = decode_batch(env.r2t, env.alloc, env.coord, reqs)
        batch.seq_lens = t64(*committed)  # what the FutureMap resolves on the device
        with speculative_server_args():
            seams.eagle_prepare_for_decode(EagleDraftInputV2Mixin.prepare_for_decode,
                                           EagleDraftInput(), batch)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        locs = verify_locs(env.r2t, reqs, committed, N)
        batch.out_cache_loc = locs.reshape(-1)
        assert seams.map_verify_slots(None, None, env.r2t, batch, None) is None
        rows = env.alloc.translate_to_physical(batch.out_cache_loc)
        assert bool((rows > 0).all()), "a verify slot is unmapped"
        positions = torch.cat([torch.arange(s, s + N) for s in committed])
        for layer in range(env.pool.layer_num):  # the verify forward
            put_tag(env.pool.kv_buffer[layer], rows, positions)
        check_verify_reads(env, batch.req_pool_indices, committed, gen)
        assert seams.commit_verify_slots(None, None, batch, None) is None
        assert int(env.alloc.full_to_hisparse_device_index_mapping[locs.reshape(-1)].abs().sum()) == 0
        for b, r in enumerate(reqs):
            kept = (step + b) % N + 1  # accept length + 1
            host = env.coord.req_to_host_pool[r.req_pool_idx, :committed[b] + kept]
            assert get_tag(env.host.kv_buffer[1], host) == list(range(committed[b] + kept))
            committed[b] += kept
            r.kv_committed_len = committed[b]
    with speculative_server_args():
        for r in reqs:
            env.finish(r)
    assert env.drained()


def test_an_idle_or_plain_batch_passes_the_verify_hooks_untouched():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_hisparse.adapter import speculative as seams

    env = Env(phys=2048)  # no verify step: draft_tokens 1
    batch = decode_batch(env.r2t, env.alloc, env.coord, [])
    batch.forward_mode = ForwardMode.IDLE
    assert seams.map_verify_slots(None, None, env.r2t, batch, None) is None
    assert seams.commit_verify_slots(None, None, batch, None) is None
    assert env.drained()


def test_a_verify_steps_indexer_returns_token_positions():
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
    from sglang.srt.layers.attention.dsa_backend import DSAIndexerMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_hisparse.adapter.speculative import verify_indexer_metadata

    fused = DSAIndexerMetadata(attn_metadata=None, topk_transform_method=TopkTransformMethod.PAGED)
    # The backend is a GPU object; the hook reads its coordinator only.
    backend = types.SimpleNamespace(hisparse_coordinator=object())
    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    got = verify_indexer_metadata(fused, backend, 0, verify)
    assert got.force_unfused_topk and got.topk_transform_method is TopkTransformMethod.PAGED
    # Prefill, or no HiSparse: SGLang's own choice stands.
    assert verify_indexer_metadata(fused, backend, 0,
                                   types.SimpleNamespace(forward_mode=ForwardMode.EXTEND)) is None
    assert verify_indexer_metadata(fused, types.SimpleNamespace(hisparse_coordinator=None), 0,
                                   verify) is None


@pytest.mark.parametrize("draft", [True, False])
def test_the_draft_runner_runs_without_hisparse_over_the_logical_ids(draft):
    """The model runner needs a GPU to build: its attributes the hooks read."""
    from sglang_hisparse.adapter.speculative import (
        draft_pool_for_logical_ids, draft_runner_without_hisparse,
    )

    env = Env(phys=1024, ratio=4)
    runner = types.SimpleNamespace(is_draft_worker=draft, enable_hisparse=True,
                                   token_to_kv_pool_allocator=env.alloc, max_total_num_tokens=1024)
    assert draft_runner_without_hisparse(runner) is None
    assert runner.enable_hisparse is (not draft)
    sized, kwargs = [], {}
    try:
        from sglang.srt.mem_cache.kv_cache_configurator import _PoolSizes
    except ImportError:  # before 0.5.17 the pools are sized by the runner's own field
        pass
    else:  # 0.5.17: KVCacheConfigurator._init_pools(*, sizes, ...)
        kwargs["sizes"] = _PoolSizes(
            max_total_num_tokens=1024, max_running_requests=8, full_max_total_num_tokens=None,
            swa_max_total_num_tokens=None, c4_max_total_num_tokens=0,
            c128_max_total_num_tokens=0, c4_state_pool_size=0, c128_state_pool_size=0,
            c4_state_dtype=None, c128_state_dtype=None)

    def init_pools(self, **kw):
        sizes = kw.get("sizes")
        sized.append(self.max_total_num_tokens if sizes is None else sizes.max_total_num_tokens)
        assert sizes is None or sizes.max_running_requests == 8  # the rest is kept

    draft_pool_for_logical_ids(init_pools, runner, **kwargs)
    assert sized == [4096 if draft else 1024]
    assert runner.max_total_num_tokens == 1024  # restored for everything after the pools
    if kwargs:
        assert kwargs["sizes"].max_total_num_tokens == 1024  # the caller's sizes untouched


def test_a_joining_batch_carries_the_draft_state_its_prefill_stashed():
    """The real patched _build_hisparse_decode_batch with a real FutureMap:
    a request's prefill stashed its draft state by req_pool_idx, it waited in
    staging while another request's step overwrote nothing of it, it joins a
    running batch, and SGLang's own resolve gathers its state."""
    proc = run_python(
        """
        import json, sys, types
        sys.path.insert(0, "tests")
        import torch
        from sglang_hisparse.plugin import activate
        assert activate().applied
        from array import array
        from dataplane_fixtures import dsa_pool, prefill, req_pool, speculative_server_args
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.overlap_utils import FutureMap, resolve_forward_inputs
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from releases import installed_object
        Alloc = installed_object(
            "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseTokenToKVPoolAllocator")

        with speculative_server_args():
            pool, r2t = dsa_pool(1024), req_pool(8, 2048)
            alloc = Alloc(1024, 64, torch.bfloat16, "cpu", pool, False, 2)
            reqs = []
            for i, n in enumerate((300, 70, 90)):
                r = Req(f"r{i}", "", array("i", range(3, 3 + n)), SamplingParams(max_new_tokens=16))
                prefill(r2t, alloc, r, n)
                r.output_ids = [11 + i]
                reqs.append(r)
            spec = SpeculativeAlgorithm.EAGLE
            fmap = FutureMap(torch.device("cpu"), spec, r2t)
            H = 8
            def draft_state(rs, base):
                k = len(rs)
                return EagleDraftInput(
                    topk_p=torch.full((k, 1), base, dtype=torch.float32) + torch.arange(k)[:, None],
                    topk_index=torch.arange(k)[:, None] + int(base),
                    hidden_states=torch.full((k, H), base) + torch.arange(k)[:, None],
                    bonus_tokens=torch.tensor([r.output_ids[-1] for r in rs], dtype=torch.int32))
            # Each prefill stashes its draft state by req_pool_idx.
            for r in reqs:
                idx = torch.tensor([r.req_pool_idx])
                fmap.stash(idx, draft_state([r], 100.0 * r.req_pool_idx))
            sched = types.SimpleNamespace(
                device="cpu", req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                tree_cache=None, enable_overlap=True, spec_algorithm=spec,
                model_config=types.SimpleNamespace(vocab_size=1024, is_encoder_decoder=False),
                future_map=fmap)
            build = Scheduler._build_hisparse_decode_batch
            running = build(sched, reqs[:1])  # joined earlier
            joining = build(sched, reqs[1:])  # staged or parked meanwhile
            running.merge_batch(joining)
            # The resolve records the indices on the CUDA stream that reads
            # them; a CPU has no stream to record on.
            torch.Tensor.record_stream = lambda self, stream: None
            resolve_forward_inputs(running, fmap)
            info = running.spec_info
            stock = build.__wrapped__(sched, reqs[1:])
            print(json.dumps(dict(
                future=info.future_indices.tolist(),
                pool=[r.req_pool_idx for r in reqs],
                topk_p=info.topk_p[:, 0].tolist(), topk_index=info.topk_index[:, 0].tolist(),
                hidden=info.hidden_states[:, 0].tolist(), bonus=info.bonus_tokens.tolist(),
                stock=stock.spec_info is None)))
        """
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["future"] == res["pool"]
    want = [100.0 * i for i in res["pool"]]
    assert res["topk_p"] == want and res["hidden"] == want
    assert res["topk_index"] == [int(x) for x in want]
    assert res["bonus"] == [11, 12, 13]
    assert res["stock"]  # 0.5.13's batch has no draft state to resolve
