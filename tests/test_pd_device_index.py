"""PD with a HiSparse DeepSeek-V4 decode: the device tail lands at its own pages.

Both PD sides on CPU, from the release's own code:

* decode: a real ``DeepSeekV4TokenToKVPool(enable_hisparse=True)`` with our
  C4 pool, SGLang's SWA allocator inside our C4 allocator, our coordinator
  and C4 host pool; 0.5.13's ``DecodePreallocQueue`` (built without its
  constructor, which needs a transfer engine) registers its KV with its own
  ``_init_kv_manager`` (fake backend: only the manager class differs, the
  registered buffers are the release's) and pops the request with
  ``pop_preallocated`` (the release's, or with our patch) through the
  patched ``_pre_alloc``; a real ``MooncakeKVReceiver`` builds the
  registration and metadata messages;
* prefill: a plain ``DeepSeekV4TokenToKVPool`` (compress ratios
  [0, 4, 128, 4]) filled with page tags; 0.5.13's ``MooncakeKVManager``
  (built without its constructor) parses the messages with
  ``KVArgsRegisterInfo.from_zmq`` / ``TransferInfo.from_zmq`` and sends
  with its ``transfer_worker`` (the plugin's patch) and ``send_kvcache``
  (our AROUND hook) down to ``_send_kvcache_generic``.

Stood in, and nothing else: the ZMQ socket the receiver sends on (the
messages are kept) and ``MooncakeKVManager._transfer_data``, the engine's
``batch_transfer_sync``: it copies each block in this process, and refuses
(-1, nothing written) a batch with any block outside the decode's
registered buffers, as the engine does (``tests/test_pd_transfer.py``,
``ret_beyond``). The engine needs libibverbs, which CPU CI may lack.
"""

from __future__ import annotations

import ctypes
import threading
from collections import defaultdict
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch

from dataplane_fixtures import (
    decode_node_server_args, dsv4_pool, installed_server_args, make_req, patched_pre_alloc, req_pool,
)
from sglang_hisparse.adapter.disaggregation_device_index import (
    HOST_PAGE_OFFSET, TAG, pack_device_tail_pages, send_kvcache_with_device_tail, unpack_pages,
    unpack_transfer_info,
)
from sglang_hisparse.manifest import ENTRIES, Kind
from sglang_hisparse.pinned_source import sglang_version
from sglang_hisparse.plugin import check_entry

RATIOS = [0, 4, 128, 4]
PS, FULL, SWA = 256, 8192, 4096
PROMPT = 700  # 3 full pages; 175 C4 tokens: 3 host pages
ROOM, SESSION = 777, "decode-session"
POP = "sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated"
WORKER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker"
SEND = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache"


def _entry(target):
    # (the hook or patch: pop_preallocated is a DEPENDS entry again from 0.5.17)
    (entry,) = [e for e in ENTRIES if e.kind is not Kind.DEPENDS and e.target == target]
    return entry


NATIVE = not _entry(SEND).applies_to(sglang_version())
pytestmark = pytest.mark.skipif(
    NATIVE, reason=f"sglang {sglang_version()} carries device_kv_indices itself (native in 0.5.17)")


def installed(target):
    """What the plugin installs for ``target`` on this release."""
    check = check_entry(_entry(target), sglang_version())
    assert check.ok, check.detail
    return check.hook


# ------------------------------------------------------------- the wire format
def test_pack_and_unpack_round_trip():
    packed = pack_device_tail_pages(np.array([4, 9, 2]), np.array([7, 8, 1]), host_entries=2)
    assert packed.dtype == np.int32 and packed.size == 9 and int(packed[-1]) == TAG
    # what a prefill without the plugin would use as destination pages
    assert (packed[:3] >= HOST_PAGE_OFFSET).all()
    pages = unpack_pages(packed)
    assert pages.host.tolist() == [4, 9, 2] and pages.device.tolist() == [7, 8, 1]
    assert pages.host_entries == 2
    assert pages.send_kwargs(slice(1, 3))["dst_device_kv_indices"].tolist() == [8, 1]


def test_a_plain_vector_is_all_host_pages():
    plain = np.array([3, 5, 6], dtype=np.int32)
    pages = unpack_pages(plain)
    assert pages.device is None and pages.host is plain and pages.send_kwargs(slice(0, 3)) == {}


def test_a_last_full_page_without_a_c4_group_is_dropped_fewer_device_pages_refused():
    # 769 tokens: 4 full pages, 192 C4 tokens = 3 host pages
    assert unpack_pages(pack_device_tail_pages([1, 2, 3], [5, 6, 7, 8], 2)).device.tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="do not match"):
        pack_device_tail_pages([1, 2, 3], [5, 6], 2)


def test_a_malformed_tagged_vector_is_refused(caplog):
    bad = np.array([HOST_PAGE_OFFSET, 5, 2, 7, TAG], dtype=np.int32)  # 7 pages claimed
    with pytest.raises(ValueError, match="malformed"):
        unpack_pages(bad)
    # in the transfer worker: used as it came (the offset pages fail the send)
    info = SimpleNamespace(room=1, dst_kv_indices=bad)
    pages = unpack_transfer_info(info)
    assert pages.device is None and pages.host is bad and "malformed" in caplog.text
    assert unpack_transfer_info(info) is pages  # once per destination


# ------------------------------------------------------------------ the nodes
def _tag(entry: int, page: int) -> int:
    return (entry * 31 + page * 7 + 1) % 251 + 1


class Prefill:
    """A DeepSeek-V4 prefill without HiSparse: every page of every registered
    buffer holds a tag naming (entry, page)."""

    def __init__(self):
        from sglang.srt.disaggregation.base.conn import KVArgs

        self.pool = dsv4_pool(compression_ratios=RATIOS, swa_size=SWA, c4_size=FULL // 4,
                              c128_size=FULL // 128, state_pool_size=16, page_size=PS)
        self.buffers = (list(self.pool.c4_kv_pool.kv_buffer)
                        + list(self.pool.c4_indexer_kv_pool.index_k_with_scale_buffer)
                        + list(self.pool.c128_kv_pool.kv_buffer))
        for entry, buf in enumerate(self.buffers):
            for page in range(buf.shape[0]):
                buf[page].fill_(_tag(entry, page))
        # what PrefillBootstrapQueue._init_kv_manager registers (prefill.py:150-200)
        kv_args = KVArgs()
        (kv_args.kv_data_ptrs, kv_args.kv_data_lens,
         kv_args.kv_item_lens) = self.pool.get_contiguous_buf_infos()
        assert kv_args.kv_data_ptrs == [b.data_ptr() for b in self.buffers]
        kv_args.prefill_start_layer, kv_args.prefill_end_layer = 0, len(RATIOS)
        kv_args.mla_compression_ratios = list(RATIOS)
        kv_args.page_size = PS
        self.kv_args = kv_args


class Decode:
    """A HiSparse DeepSeek-V4 PD decode node (one TP rank)."""

    def __init__(self, server_args, monkeypatch):
        import sglang.srt.disaggregation.decode as decode_mod
        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend

        from test_dsv4 import build
        from sglang_hisparse.adapter.model_runner import HiSparseCoordinator

        self.pool, self.alloc = build()
        self.r2t = req_pool(8, 4096)
        self.coord = HiSparseCoordinator(self.r2t, self.alloc, 16, 128, "cpu", None, 2,
                                         pd_decode=True)
        self.host = self.coord.mem_pool_host
        # The attention TP group needs torch.distributed: one rank.
        monkeypatch.setattr(decode_mod, "get_attention_tp_size", lambda: 1)
        q = object.__new__(DecodePreallocQueue)
        q.__dict__.update(
            transfer_backend=TransferBackend.FAKE, tp_rank=0, pp_rank=0, pp_size=1,
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None, is_mla_backend=True,
            enable_staging=False, req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.alloc,
            metadata_buffers=SimpleNamespace(get_buf_infos=lambda: ([0], [64], [64])),
            scheduler=SimpleNamespace(
                enable_hisparse=True, hisparse_coordinator=self.coord, server_args=server_args,
                running_batch=SimpleNamespace(reqs=[]), waiting_queue=[], last_batch=None,
                sliding_window_size=128,
                enable_priority_scheduling=False,
                enable_decode_hicache=False, ps=SimpleNamespace(dp_rank=0, gpu_id=0, pp_size=1),
                model_config=SimpleNamespace(num_hidden_layers=len(RATIOS))),
            tree_cache=None, transfer_queue=SimpleNamespace(queue=[], enable_staging=False),
            req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(4),
            num_reserved_decode_tokens=64, max_total_num_tokens=FULL,
            queue=[], retracted_queue=[], pending_reqs=[])
        # The release's registration (fake backend: the KV args are what a
        # Mooncake decode registers; only the manager class differs).
        self.kv_args = q._init_kv_manager().kv_args
        q.kv_manager = SimpleNamespace(kv_args=self.kv_args)
        q._pre_alloc = MethodType(patched_pre_alloc(), q)
        self.prealloc = q
        self.c4_layers = self.host.layer_num
        self.tail = (list(self.pool.c4_indexer_kv_pool.index_k_with_scale_buffer)
                     + list(self.pool.c128_kv_pool.kv_buffer))
        self.host_buffers = list(self.host.kv_buffer)
        for buf in self.tail + self.host_buffers:
            buf.zero_()

    def registered(self):
        return list(zip(self.kv_args.kv_data_ptrs, self.kv_args.kv_data_lens))


def receiver(decode, sent):
    """0.5.13's ``MooncakeKVReceiver`` of one request, bootstrapped to one
    prefill rank; its socket keeps what it sends."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver

    mgr = object.__new__(MooncakeKVManager)
    mgr.__dict__.update(kv_args=decode.kv_args, enable_staging=False, local_ip="127.0.0.1",
                        rank_port=17001, attn_tp_size=1)
    recv = object.__new__(MooncakeKVReceiver)
    sock = SimpleNamespace(send_multipart=sent.append)
    recv.__dict__.update(
        kv_mgr=mgr, session_id=SESSION, bootstrap_room=ROOM, bootstrap_addr="127.0.0.1:8998",
        bootstrap_infos=[{"rank_ip": "127.0.0.1", "rank_port": 17000, "is_dummy": False}],
        required_dst_info_num=1, init_time=None, conclude_state=None)
    recv._connect_to_bootstrap_server = lambda info: (sock, threading.Lock())
    return recv


def engine_copy(decode, writes):
    """``_transfer_data``: the engine's batch write, in this process. A batch
    with a block outside the decode's registered buffers is refused whole."""
    spans = decode.registered()

    def transfer(session, blocks):
        for src, dst, length in blocks:
            if not any(p <= dst and dst + length <= p + n for p, n in spans):
                writes.append(("refused", dst))
                return -1
        for src, dst, length in blocks:
            ctypes.memmove(dst, src, length)
            writes.append(("copied", dst))
        return 0

    return transfer


def run_transfer(patched: bool, monkeypatch, server_args, prefill_patched=None):
    """One prompt from the prefill into the decode; returns what to check."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
    from sglang.srt.disaggregation.mooncake.conn import (
        KVArgsRegisterInfo, MooncakeKVManager, TransferInfo,
    )
    from concurrent.futures import ThreadPoolExecutor

    prefill_patched = patched if prefill_patched is None else prefill_patched
    decode, prefill = Decode(server_args, monkeypatch), Prefill()
    # Another request holds the first logical pages (not host pages), so the
    # request's logical and host page numbers differ.
    t = lambda v: torch.tensor([v], dtype=torch.int64)
    decode.alloc.alloc_logical_only(t(0), t(0), t(512), t(512), t(-1), 512)

    sent = []
    recv = receiver(decode, sent)
    recv._register_kv_args()
    req = make_req("v4", PROMPT)
    decode.prealloc.queue.append(DecodeRequest(req, recv, waiting_for_input=True))
    pop = installed(POP) if patched else DecodePreallocQueue.pop_preallocated
    with installed_server_args(server_args):
        done, failed = pop(decode.prealloc)
    assert len(done) == 1 and not failed
    register_msg, metadata_msg = sent
    logical = decode.r2t.req_to_token[req.req_pool_idx, :PROMPT].long()
    logical_pages = (logical[::PS] // PS).tolist()
    host_rows = decode.coord.req_to_host_pool[req.req_pool_idx, : PROMPT // 4].long()
    host_pages = (host_rows[::64] // 64).tolist()
    assert len(logical_pages) == len(host_pages) == 3
    assert logical_pages != host_pages  # else the test could not tell them apart

    # --- the prefill: the messages as its bootstrap thread parses them
    writes, synced = [], []
    prefill_pages = np.array([6, 2, 9], dtype=np.int32)
    mgr = object.__new__(MooncakeKVManager)
    mgr.__dict__.update(
        enable_trace=False, enable_staging=False, enable_custom_mem_pool=False,
        request_status={ROOM: KVPoll.Transferring}, failure_records={},
        failure_lock=threading.Lock(), session_lock=threading.Lock(), failed_sessions=set(),
        session_failures=defaultdict(int), req_to_decode_prefix_len={}, is_mla_backend=True,
        kv_args=prefill.kv_args, attn_tp_rank=0, attn_tp_size=1, pp_size=1, pp_rank=0,
        attn_cp_size=1, attn_cp_rank=0, bootstrap_port=8998,
        decode_kv_args_table={SESSION: KVArgsRegisterInfo.from_zmq(register_msg)},
        transfer_infos={ROOM: {SESSION: TransferInfo.from_zmq(metadata_msg)}},
        send_aux=lambda *a, **kw: 0, maybe_send_extra=lambda *a, **kw: 0,
        sync_status_to_decode_endpoint=lambda ep, port, r, status, rank: synced.append(status))
    mgr._transfer_data = engine_copy(decode, writes)
    if prefill_patched:
        # the AROUND hook as HookRegistry wraps it
        from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

        hook = installed(SEND)
        assert hook is send_kvcache_with_device_tail
        mgr.send_kvcache = MethodType(
            _wrap_fn(MooncakeKVManager.send_kvcache, hook, HookType.AROUND), mgr)
    worker = installed(WORKER) if prefill_patched else MooncakeKVManager.transfer_worker
    work = FastQueue()
    # two chunks: the first page, then the rest
    work.put(TransferKVChunk(room=ROOM, prefill_kv_indices=prefill_pages[:1],
                             index_slice=slice(0, 1), is_last_chunk=False, prefill_aux_index=0,
                             state_indices=None))
    work.put(TransferKVChunk(room=ROOM, prefill_kv_indices=prefill_pages[1:],
                             index_slice=slice(1, 3), is_last_chunk=True, prefill_aux_index=0,
                             state_indices=None))
    threading.Thread(target=worker, args=(mgr, work, ThreadPoolExecutor(1)), daemon=True).start()
    for _ in range(1000):
        if synced:
            break
        threading.Event().wait(0.01)
    return SimpleNamespace(decode=decode, prefill=prefill, logical_pages=logical_pages,
                           host_pages=host_pages, prefill_pages=prefill_pages.tolist(),
                           synced=synced, writes=writes, mgr=mgr)


def tags_at(buf, pages):
    """Each page's tag (0: never written); asserts a page holds one value."""
    out = []
    for p in pages:
        row = buf[p]
        assert bool((row == row[0]).all()), "a page was written in part"
        out.append(int(row[0]))
    return out


def written_pages(buf):
    return sorted(int(p) for p in torch.nonzero(buf.reshape(buf.shape[0], -1).any(dim=1)))


@pytest.fixture
def server_args():
    with decode_node_server_args(PS) as args:
        yield args


def test_the_device_tail_lands_at_the_requests_logical_pages(monkeypatch, server_args):
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = run_transfer(True, monkeypatch, server_args)
    assert r.synced == [KVPoll.Success], r.mgr.failure_records
    c4 = r.decode.c4_layers
    # C4 layers: the host pages the prealloc chose
    for layer, buf in enumerate(r.decode.host_buffers):
        assert tags_at(buf, r.host_pages) == [_tag(layer, p) for p in r.prefill_pages]
        assert written_pages(buf) == sorted(r.host_pages)
    # the device tail (C4 indexer keys, C128 KV): the request's logical pages
    for i, buf in enumerate(r.decode.tail):
        assert tags_at(buf, r.logical_pages) == [_tag(c4 + i, p) for p in r.prefill_pages]
        assert written_pages(buf) == sorted(r.logical_pages)


def test_without_the_patches_the_tail_lands_at_host_pages(monkeypatch, server_args):
    """0.5.13's behaviour, what the patches fix: one index vector (host
    pages) for every entry, so the tail's rows at the request's logical pages
    stay empty and other pages (another request's) are overwritten."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = run_transfer(False, monkeypatch, server_args)
    assert r.synced == [KVPoll.Success]
    c4 = r.decode.c4_layers
    for i, buf in enumerate(r.decode.tail):
        assert tags_at(buf, r.host_pages) == [_tag(c4 + i, p) for p in r.prefill_pages]
        stale = [p for p in r.logical_pages if p not in r.host_pages]
        assert stale and tags_at(buf, stale) == [0] * len(stale)
        assert written_pages(buf) == sorted(r.host_pages)


def test_a_prefill_without_the_plugin_fails_the_request_and_writes_nothing(
        monkeypatch, server_args):
    """Our decode, a prefill running 0.5.13 alone: it reads the packed vector
    as destination pages, 2**30 pages past every buffer; the engine refuses
    the first batch and the request fails on both sides, no byte written."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = run_transfer(True, monkeypatch, server_args, prefill_patched=False)
    assert r.synced == [KVPoll.Failed]
    assert r.writes and all(kind == "refused" for kind, _ in r.writes)
    for buf in r.decode.host_buffers + r.decode.tail:
        assert written_pages(buf) == []


def test_a_layout_mismatch_is_refused_not_sent(caplog):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    prefill = Prefill()
    mgr = object.__new__(MooncakeKVManager)
    mgr.__dict__.update(kv_args=prefill.kv_args)
    mgr._send_kvcache_generic = lambda **kw: pytest.fail("sent despite the mismatch")
    ptrs = prefill.kv_args.kv_data_ptrs
    pages = np.array([1], dtype=np.int32)
    # the decode says 1 host-backed entry, this prefill has 2 C4 layers
    assert send_kvcache_with_device_tail(
        MooncakeKVManager.send_kvcache, mgr, SESSION, pages, ptrs, pages, None,
        dst_device_kv_indices=pages, dst_host_entries=1) == -1
    # one entry fewer on the decode (another PP layout, another model)
    assert send_kvcache_with_device_tail(
        MooncakeKVManager.send_kvcache, mgr, SESSION, pages, ptrs[:-1], pages, None,
        dst_device_kv_indices=pages, dst_host_entries=2) == -1
    assert "HiSparse DeepSeek-V4 PD transfer refused" in caplog.text
