"""A PD decode node on CPU under host pressure, through 0.5.13's own prealloc
queue: the pd-press stall of the third GPU session (docs/gpu-runs/2026-12-02-third).

The node is 0.5.13's ``DecodePreallocQueue`` (its ``pop_preallocated``,
budget and ``resume_retracted_reqs`` methods; built without its constructor,
which needs a transfer engine and a process group), the patched
``_pre_alloc`` the plugin installs, fake-backend receivers (0.5.13's own
``FakeKVReceiver``: the transfer is "done" once the prealloc sent its
metadata) and a real running ``ScheduleBatch`` whose ``check_decode_mem`` /
``retract_decode`` / ``prepare_for_decode`` run as the decode loop runs them.
The test plays the prefill node (it writes each prompt's KV tags into the
host rows the prealloc chose) and the forward (each new token's tag), and
checks every request's host KV before it finishes.

What the GPU run showed, and what these tests pin down:

* with a ratio-1 host pool, 0.5.13's prealloc admits prompts while the
  prompt plus a few reserved tokens fit; the running requests then outgrow
  the host pool, retraction keeps their KV on host (it frees no host row),
  so SGLang retracts them all and aborts the last, and a retracted request
  can never resume: ``_pre_alloc`` wanted fresh host rows for its whole KV
  beside the rows it kept. Nothing progressed until the stage timed out;
* now the PD token budget reserves what every request may still write, so
  the next prompt waits in the prealloc queue while the running ones decode
  to the end, and a resuming request takes back the rows it kept.
"""

from array import array
from types import MethodType, SimpleNamespace

import pytest
import torch

from dataplane_fixtures import (
    drained,
    PS, chunk_cache, decode_batch, decode_node_server_args, dsa_pool, free_counts, get_tag,
    kv_allocated_len, patched_pre_alloc, put_tag, release, req_pool,
)
from sglang_hisparse.adapter.model_runner import HiSparseCoordinator
from sglang_hisparse.engine.state import ReqState
from sglang_hisparse.pools.allocator import HiSparseDualAllocator
from sglang_hisparse.pools.device_dsa import HiSparseDSADevicePool

HOT, TOPK, RESERVED = 128, 16, 64
DEVICE_ROWS = 1024


@pytest.fixture
def server_args():
    with decode_node_server_args(PS) as args:
        yield args


def put_index_tag(bufs, logical, tags):
    """Tags into the indexer's K bytes of logical locations (one page of
    ``PS`` tokens per buffer row: ``PS x 128`` key bytes, then the scales)."""
    logical, tags = torch.as_tensor(logical).long(), torch.as_tensor(tags).long()
    page, off = logical // PS, (logical % PS) * 128
    for buf in bufs:
        buf[page, off] = (tags % 256).to(torch.uint8)
        buf[page, off + 1] = (tags // 256).to(torch.uint8)


def get_index_tag(buf, logical):
    logical = torch.as_tensor(logical).long()
    page, off = logical // PS, (logical % PS) * 128
    return (buf[page, off].long() + 256 * buf[page, off + 1].long()).tolist()


class PDNode:
    """A HiSparse PD decode node with a ratio-``ratio`` host pool (``DEVICE_ROWS
    x ratio`` host rows), scheduled by 0.5.13's prealloc queue. The prefill
    node's KV and every forward write tags: latent KV ``position``, indexer
    keys ``position + 1 + index_tag_base[rid]`` (0 by default)."""

    def __init__(self, server_args, ratio=1, max_reqs=8):
        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        self.server_args = server_args
        self.pool = HiSparseDSADevicePool(
            DEVICE_ROWS, page_size=PS, kv_lora_rank=512, dtype=torch.bfloat16,
            qk_rope_head_dim=64, layer_num=dsa_pool(PS).layer_num, device="cpu",
            index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576,
            host_to_device_ratio=ratio)
        self.index_tag_base = {}
        self.r2t = req_pool(max_reqs, 2048)
        self.alloc = HiSparseDualAllocator(DEVICE_ROWS, PS, torch.bfloat16, "cpu", self.pool,
                                           False, ratio)
        self.coord = HiSparseCoordinator(self.r2t, self.alloc, TOPK, HOT, "cpu", None, ratio,
                                         swap_in_block_size=1024, pd_decode=True,
                                         pd_growth_clip=4096, index_roles=None)
        self.host = self.coord.mem_pool_host
        self.cache = chunk_cache(self.r2t, self.alloc)
        self.running = ScheduleBatch(reqs=[])
        self.scheduler = SimpleNamespace(
            enable_hisparse=True, hisparse_coordinator=self.coord, server_args=server_args,
            running_batch=self.running, waiting_queue=[], last_batch=None,
            enable_priority_scheduling=False, enable_decode_hicache=False,
            ps=SimpleNamespace(pp_size=1))
        q = object.__new__(DecodePreallocQueue)
        q.__dict__.update(
            req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
            token_to_kv_pool=self.pool, tree_cache=self.cache, scheduler=self.scheduler,
            transfer_queue=SimpleNamespace(queue=[], enable_staging=False),
            req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(max_reqs),
            kv_manager=SimpleNamespace(kv_args=SimpleNamespace(state_types=[])),
            num_reserved_decode_tokens=RESERVED, max_total_num_tokens=DEVICE_ROWS * ratio,
            queue=[], retracted_queue=[], pending_reqs=[],
            pp_size=1)  # 0.5.17's pop_preallocated reads it (set in __init__ from scheduler.ps)
        # what the plugin installs in place of 0.5.13's
        q._pre_alloc = MethodType(patched_pre_alloc(), q)
        self.prealloc = q
        self.start = self.counts()
        self.finished, self.aborted, self.retracted = [], [], 0

    def counts(self):
        return free_counts(self.alloc, self.host, self.r2t)

    def arrive(self, rid, prompt, max_new):
        """A request the router sent (its prefill node will write the prompt's KV)."""
        from sglang.srt.disaggregation.decode import DecodeRequest
        from sglang.srt.disaggregation.fake.conn import FakeKVReceiver
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", [1] * prompt), SamplingParams(max_new_tokens=max_new))
        receiver = FakeKVReceiver(None, "2.2.2.2:8998")
        receiver.init(0)  # bootstrap done
        self.prealloc.queue.append(DecodeRequest(req, receiver, waiting_for_input=True))
        return req

    def admit(self):
        """One ``pop_preallocated``; the prefill node then writes each admitted
        prompt's KV and the first token arrives (the transfer succeeds)."""
        done, failed = self.prealloc.pop_preallocated()
        assert not failed
        for dr in done:
            req, n = dr.req, len(dr.req.origin_input_ids)
            assert self.coord.state_of(req) is ReqState.TRANSFERRING
            host = self.coord.req_to_host_pool[req.req_pool_idx, :n]
            for layer in range(self.pool.layer_num):
                put_tag(self.host.kv_buffer[layer], host, torch.arange(n))
            # the prefill's indexer keys (0.5.13 transfers them as state, by logical page)
            put_index_tag(self.pool.index_k_with_scale_buffer,
                          self.r2t.req_to_token[req.req_pool_idx, :n],
                          torch.arange(n) + 1 + self.index_tag_base.get(req.rid, 0))
            self.prealloc.req_to_metadata_buffer_idx_allocator.free(dr.metadata_buffer_index)
            req.output_ids.append(7)  # the prefill's first token
            self.coord.admit_request_direct(req)  # process_decode_queue
            self.running.reqs.append(req)
        return [dr.req for dr in done]

    def resume(self):
        resumed = self.prealloc.resume_retracted_reqs()
        self.running.reqs.extend(resumed)
        return resumed

    def step(self):
        """One decode step of the running batch, as the decode loop runs it:
        retract while memory is short, prepare, "forward", finish."""
        reqs = self.running.reqs
        if not reqs:
            return
        batch = decode_batch(self.r2t, self.alloc, self.coord, reqs)
        if not batch.check_decode_mem():
            retracted, _, aborted = batch.retract_decode(self.server_args)
            self.retracted += len(retracted)
            for req in retracted:
                self.prealloc.add(req, is_retracted=True)
            self.aborted += aborted  # (released whole by retract_decode)
            reqs = batch.reqs
            if not reqs:
                self.running.reqs = []
                return
        batch.prepare_for_decode()
        rows = self.alloc.translate_to_physical(batch.out_cache_loc)
        for layer in range(self.pool.layer_num):
            put_tag(self.pool.kv_buffer[layer], rows, batch.seq_lens - 1)
        base = torch.tensor([self.index_tag_base.get(r.rid, 0) for r in reqs])
        put_index_tag(self.pool.index_k_with_scale_buffer, batch.out_cache_loc,
                      batch.seq_lens + base)  # the indexer's key of position seq_len - 1
        keep = []
        for req in reqs:
            req.output_ids.append(7)
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                self.check_host_kv(req)
                self.coord.request_finished(req)
                release(self.r2t, self.alloc, req)
                self.finished.append(req)
            else:
                keep.append(req)
        self.running.reqs = keep

    def check_host_kv(self, req):
        n = kv_allocated_len(req) - 1  # the newest token is written through next step
        host = self.coord.req_to_host_pool[req.req_pool_idx, :n]
        for layer in range(self.pool.layer_num):
            assert get_tag(self.host.kv_buffer[layer], host) == list(range(n)), req.rid

    def index_tags(self, req, n):
        """The indexer keys of the request's positions [0, n), per layer."""
        logical = self.r2t.req_to_token[req.req_pool_idx, :n]
        return [get_index_tag(buf, logical) for buf in self.pool.index_k_with_scale_buffer]

    def drained(self):
        return drained(self)


def test_host_pool_too_full_for_the_next_prompt_makes_it_wait(server_args):
    # 4 x (200 + 200) tokens on a 1024-row host pool: two fit to the end.
    node = PDNode(server_args)
    reqs = [node.arrive(f"p{i}", 200, 200) for i in range(4)]
    waited = 0
    for _ in range(2000):
        node.resume()
        node.admit()
        waited += bool(node.prealloc.queue) and bool(node.running.reqs)
        node.step()
        if len(node.finished) + len(node.aborted) == len(reqs):
            break
    assert sorted(r.rid for r in node.finished) == [r.rid for r in reqs], \
        (len(node.finished), node.retracted, [r.rid for r in node.aborted])
    assert not node.aborted and node.retracted == 0
    assert waited > 0  # the later prompts waited in the prealloc queue
    assert node.drained()
    # and the node serves the next request
    node.arrive("next", 300, 8)
    assert [r.rid for r in node.admit()] == ["next"]


def test_a_retracted_request_resumes_into_a_host_pool_full_of_kept_kv(server_args):
    # Two requests retracted (SGLANG_TEST_RETRACT's way: every request)
    # keep 2 x 448 host rows, more than the rows left free. Each resumes from its own
    # rows: 0.5.13 wanted 448 fresh rows for each first, and never resumed.
    node = PDNode(server_args)
    reqs = [node.arrive(f"r{i}", 400, 20) for i in range(2)]
    while len(node.running.reqs) < 2:
        assert node.admit(), "the node admits both prompts"
    node.step()
    batch = decode_batch(node.r2t, node.alloc, node.coord, node.running.reqs)
    from sglang.srt.managers.schedule_batch import release_req

    for i in range(len(batch.reqs)):
        release_req(req=batch.reqs[i], remaing_req_count=0, server_args=server_args,
                    req_to_token_pool=node.r2t, token_to_kv_pool_allocator=node.alloc,
                    tree_cache=node.cache, hisparse_coordinator=node.coord)
        node.prealloc.add(batch.reqs[i], is_retracted=True)
    node.running.reqs = []
    assert node.host.available_size() < 448  # fewer than either request holds
    for _ in range(200):
        node.resume()
        node.step()
        if len(node.finished) == 2:
            break
    assert sorted(r.rid for r in node.finished) == [r.rid for r in reqs]
    assert node.drained()


def test_a_failed_transfer_frees_the_host_rows_of_its_prealloc(server_args):
    # 0.5.13 pop_transferred on KVPoll.Failed (an abort in flight, a dead
    # prefill, a bootstrap timeout): request_finished, then release_kv_cache.
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    node = PDNode(server_args)
    node.arrive("lost", 300, 20)
    done, _ = node.prealloc.pop_preallocated()
    (dr,) = done
    dr.kv_receiver.abort()  # what Scheduler.abort_request does to a transfer
    assert dr.kv_receiver.poll() == KVPoll.Failed
    dr.req.to_finish = FINISH_ABORT()
    node.coord.request_finished(dr.req)
    release(node.r2t, node.alloc, dr.req)
    node.prealloc.req_to_metadata_buffer_idx_allocator.free(dr.metadata_buffer_index)
    assert node.drained()
    node.arrive("next", 300, 8)
    assert [r.rid for r in node.admit()] == ["next"]


def test_a_resumed_request_reads_the_kv_and_indexer_keys_of_one_never_retracted(server_args):
    # The pd-retract divergence of the third GPU session: the DSA indexer's
    # keys live on the device by logical page, retraction freed those pages
    # and the resumed request's new pages held another request's keys (or
    # zeros), so its top-k differed. "kept" is retracted mid-decode, "other"
    # arrives while it waits and takes its freed pages; "never" decodes
    # through. After the resume, what the next decode steps read must be what
    # "never" has at the same positions.
    from sglang.srt.managers.schedule_batch import release_req

    node = PDNode(server_args, ratio=2)
    kept, never = node.arrive("kept", 200, 80), node.arrive("never", 200, 80)
    while len(node.running.reqs) < 2:
        assert node.admit()
    for _ in range(20):
        node.step()
    batch = decode_batch(node.r2t, node.alloc, node.coord, node.running.reqs)
    i = batch.reqs.index(kept)
    release_req(req=kept, remaing_req_count=0, server_args=server_args,
                req_to_token_pool=node.r2t, token_to_kv_pool_allocator=node.alloc,
                tree_cache=node.cache, hisparse_coordinator=node.coord)
    node.prealloc.add(kept, is_retracted=True)
    node.running.reqs = [r for j, r in enumerate(node.running.reqs) if j != i]
    node.index_tag_base["other"] = 5000  # foreign keys in the pages "kept" freed
    node.arrive("other", 200, 10)
    assert node.admit()
    # "other" finishes before "kept" resumes: "kept" gets pages "other" wrote
    while any(r.rid == "other" for r in node.running.reqs):
        node.step()
    assert [r.rid for r in node.resume()] == ["kept"]
    for _ in range(3):
        n = kv_allocated_len(kept)  # positions whose KV the next step reads
        assert kept.kv_committed_len == n == len(kept.origin_input_ids) + len(kept.output_ids) - 1
        assert node.index_tags(kept, n) == [list(range(1, n + 1))] * node.pool.layer_num
        assert node.index_tags(kept, n) == node.index_tags(never, n)
        on_host = n - (1 if node.coord.requests.record(kept.req_pool_idx).skip_first_backup else 0)
        host_k = node.coord.req_to_host_pool[kept.req_pool_idx, :n - 1]
        host_n = node.coord.req_to_host_pool[never.req_pool_idx, :n - 1]
        for layer in range(node.pool.layer_num):
            assert get_tag(node.host.kv_buffer[layer], host_k) == list(range(n - 1))
            assert get_tag(node.host.kv_buffer[layer], host_k) == \
                get_tag(node.host.kv_buffer[layer], host_n)
        assert on_host >= n - 1
        node.step()
    for _ in range(200):
        node.step()
        if not node.running.reqs:
            break
    assert sorted(r.rid for r in node.finished) == ["kept", "never", "other"]
    assert node.drained()
