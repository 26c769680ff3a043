"""PD decode retraction on CPU (sglang#40729): a retracted request keeps its KV
in the host pool and resumes from it.

Retraction runs 0.5.13's own ``release_req`` (``retract_req``,
``Req.offload_kv_cache`` -> ``get_cpu_copy``, ``release_kv_cache`` through a
real ``ChunkCache``, ``reset_for_retract``); resumption runs 0.5.13's own
``DecodePreallocQueue._pre_alloc`` (unbound: the queue needs a scheduler and
a transfer engine) and ``Req.load_kv_cache``; an abort runs 0.5.13's
``Scheduler.abort_request`` inside our hook. Every lifecycle test counts
logical, physical, host and request slots back to the start.
"""

import inspect
from array import array

import pytest
import torch

from dataplane_fixtures import (
    drained,
    PS, abort, abort_scheduler, chunk_cache, decode_step, dsa_pool, free_counts, get_tag,
    decode_node_server_args, kv_allocated_len,
    make_req, pre_alloc, put_tag, release, req_pool, t64,
)
from sglang_hisparse.pools.allocator import HiSparseDualAllocator
from sglang_hisparse.adapter.model_runner import HiSparseCoordinator
from sglang_hisparse.engine.policies.retain_on_retract import RetainedHostKV

HOT, TOPK = 128, 16


@pytest.fixture
def server_args():
    """The global ServerArgs ``release_kv_cache`` reads, as on a PD decode node."""
    with decode_node_server_args(PS) as args:
        yield args


class PDEnv:
    def __init__(self, pd_decode=None):
        self.pool = dsa_pool(1024)
        self.r2t = req_pool(8, 2048)
        self.alloc = HiSparseDualAllocator(1024, PS, torch.bfloat16, "cpu", self.pool, False, 2)
        # (a block size given: the configured one would be read from the
        # global server args' model config, which "dummy" does not have)
        self.coord = HiSparseCoordinator(self.r2t, self.alloc, TOPK, HOT, "cpu", None, 2,
                                         swap_in_block_size=1024, pd_decode=pd_decode)
        self.host = self.coord.mem_pool_host
        self.cache = chunk_cache(self.r2t, self.alloc)
        self.start = self.counts()

    def counts(self):
        return free_counts(self.alloc, self.host, self.r2t)

    def pre_alloc(self, req):
        """0.5.13's ``DecodePreallocQueue._pre_alloc``: a request slot,
        logical slots only, host rows for the transfer (or, after
        retraction, the restore)."""
        return pre_alloc(self.r2t, self.alloc, self.coord, req)

    def admit(self, rid, n):
        """A request whose prompt KV the prefill node wrote into host rows."""
        req = make_req(rid, n)
        host = self.pre_alloc(req)
        for layer in range(self.pool.layer_num):
            put_tag(self.host.kv_buffer[layer], host[:n], torch.arange(n))
        self.coord.admit_request_direct(req)
        return req

    def decode(self, req):
        """One decode step; the "forward" writes the new token's KV."""
        _, seq, out = decode_step(self.r2t, self.alloc, self.coord, [req])
        rows = self.alloc.translate_to_physical(out)
        for layer in range(self.pool.layer_num):
            put_tag(self.pool.kv_buffer[layer], rows, seq - 1)

    def retract(self, req, server_args):
        from sglang.srt.managers.schedule_batch import release_req

        release_req(req=req, remaing_req_count=0, server_args=server_args,
                    req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                    tree_cache=self.cache, hisparse_coordinator=self.coord)

    def host_tags(self, rows):
        return [get_tag(self.host.kv_buffer[layer], rows) for layer in range(self.pool.layer_num)]

    def drained(self):
        return drained(self)


def generated(req, steps, lag):
    """Output ids as SGLang holds them after ``steps`` decode steps: with the
    overlap scheduler (lag 1) the last step's token is not processed yet."""
    req.output_ids = array("q", [7] * (steps + 1 - lag))


def retracted_after_one_step(env, server_args, to_finish=None, rid="pd-1"):
    req = env.admit(rid, 300)
    env.decode(req)
    generated(req, 1, 0)
    req.to_finish = to_finish
    env.retract(req, server_args)
    return req


@pytest.mark.parametrize("prompt", [90, 400])  # shorter / longer than the hot buffer
@pytest.mark.parametrize("steps,lag", [(1, 0), (5, 0), (5, 1), (0, 0)])
def test_retracted_request_resumes_from_its_host_rows(server_args, prompt, steps, lag):
    env = PDEnv()
    req = env.admit("pd", prompt)
    for _ in range(steps):
        env.decode(req)
    generated(req, steps, lag)
    want = prompt + steps - lag  # SGLang's snapshot length: seqlen - 1
    rows_before = env.host.available_size()

    env.retract(req, server_args)

    kept = req.kv_cache_cpu
    assert isinstance(kept, RetainedHostKV) and kept.num_tokens == want
    # only the retained host rows are still taken; the newest token joined them
    now = env.counts()
    assert {k: now[k] for k in ("logical", "physical", "req")} == \
        {k: env.start[k] for k in ("logical", "physical", "req")}, (now, env.start)
    held = kept.rows.numel()  # whole pages
    assert now["host"] == env.start["host"] - held <= rows_before
    assert not env.coord.live_request_slots()
    for tags in env.host_tags(kept.rows[:want]):
        assert tags == list(range(want))

    env.pre_alloc(req)  # resume_retracted_reqs: new slot, new host rows
    req.load_kv_cache(env.r2t, env.alloc)
    assert not hasattr(req, "kv_cache_cpu") and kept.rows is None
    idx = req.req_pool_idx
    assert env.coord.live_request_slots() == [idx]
    assert env.host.available_size() == env.start["host"] - held  # the new rows went back
    for tags in env.host_tags(env.coord.req_to_host_pool[idx, :want]):
        assert tags == list(range(want))
    if want <= HOT:  # a short request is preloaded into its hot buffer
        dev_rows = env.coord.req_to_device_buffer[idx, :want]
        assert get_tag(env.pool.kv_buffer[1], dev_rows) == list(range(want))

    for _ in range(3):
        env.decode(req)
    host = env.coord.req_to_host_pool[idx, :kv_allocated_len(req) - 1]
    for tags in env.host_tags(host):  # write-through went on from the restored rows
        assert tags == list(range(kv_allocated_len(req) - 1))
    env.coord.request_finished(req)
    release(env.r2t, env.alloc, req)
    assert env.drained()


def test_abort_while_retracted_frees_the_retained_rows(server_args):
    # 0.5.13's own abort_request drops the snapshot (del kv_cache_cpu) and
    # tells the tokenizer; the hook around it frees the host rows first.
    from sglang.srt.managers.io_struct import AbortReq

    env = PDEnv()
    req = retracted_after_one_step(env, server_args)
    kept = req.kv_cache_cpu
    assert kept.holds_rows
    other = retracted_after_one_step(env, server_args, rid="x-1")
    sched, sent = abort_scheduler(env.coord, env.r2t, env.alloc, decode=True,
                                  retracted=[req, other])

    abort(sched, "pd")

    assert not hasattr(req, "kv_cache_cpu") and not kept.holds_rows
    assert sched.disagg_decode_prealloc_queue.retracted_queue == [other]
    assert [type(o) for o in sent] == [AbortReq] and [o.rid for o in sent] == ["pd-1"]
    env.coord.release_retained(other.kv_cache_cpu)
    assert env.drained()


def test_request_aborted_in_the_retraction_is_released_whole(server_args):
    # 0.5.13 retract_decode aborts the last request when even it does not fit
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    env = PDEnv()
    req = retracted_after_one_step(env, server_args, to_finish=FINISH_ABORT())
    assert not req.kv_cache_cpu.holds_rows
    assert env.drained()


def test_a_retraction_without_offload_keeps_nothing_on_host(server_args):
    """0.5.17's rebootstrap retraction (``pause_generation(mode="retract")``
    calls ``release_req(..., offload_kv=False)``: the prefill recomputes the
    KV, nobody takes a CPU copy). Through our hook each request's host rows
    go back whole, so the next retraction finds the hand-off free."""
    from sglang.srt.managers.schedule_batch import release_req

    from sglang_hisparse.adapter.scheduler import release_req_without_offload

    env = PDEnv()
    reqs = [env.admit(rid, 300) for rid in ("a-1", "b-1")]
    for req in reqs:
        env.decode(req)
        generated(req, 1, 0)
    takes_offload = "offload_kv" in inspect.signature(release_req).parameters

    def original(**kw):
        if takes_offload:
            return release_req(**kw)
        # Before 0.5.17 nothing calls it so: what 0.5.17's does without the offload.
        kw["hisparse_coordinator"].retract_req(kw["req"])
        release(env.r2t, env.alloc, kw["req"])

    for req in reqs:
        release_req_without_offload(
            original, req=req, remaing_req_count=0, server_args=server_args,
            req_to_token_pool=env.r2t, token_to_kv_pool_allocator=env.alloc,
            tree_cache=env.cache, hisparse_coordinator=env.coord, offload_kv=False)
        assert getattr(req, "kv_cache_cpu", None) is None
    assert env.coord.retain.enabled and not list(env.coord.retain.kept())
    assert env.drained()
    # Without the hook the first request's rows stay retained for a copy nobody takes.
    first, second = env.admit("c-1", 300), env.admit("d-1", 300)
    for req in (first, second):
        env.decode(req)
        generated(req, 1, 0)
    env.coord.retract_req(first)
    with pytest.raises(RuntimeError, match="never taken by get_cpu_copy"):
        env.coord.retract_req(second)


def test_colocated_retraction_still_releases_everything():
    env = PDEnv(pd_decode=False)
    req = env.admit("r", 300)
    env.decode(req)
    env.coord.retract_req(req)
    release(env.r2t, env.alloc, req)
    assert env.drained()
    with pytest.raises(NotImplementedError, match="only on a PD decode node"):
        env.alloc.get_cpu_copy(t64(1, 2))


def test_pd_decode_is_read_from_the_server_args(server_args):
    assert PDEnv().coord.pd_decode
    server_args.disaggregation_mode = "null"
    assert not PDEnv().coord.pd_decode


def test_pinned_sglang_resumes_in_the_order_the_tests_call():
    # The tests above run 0.5.13's release_req, _pre_alloc, load_kv_cache
    # and abort_request themselves; only resume_retracted_reqs (it needs the
    # whole prealloc queue) is repeated, as its two calls in its order.
    import inspect

    from sglang.srt.disaggregation import decode

    resume = inspect.getsource(decode.DecodePreallocQueue.resume_retracted_reqs)
    assert resume.index("self._pre_alloc(req)") < resume.index("req.load_kv_cache(")
