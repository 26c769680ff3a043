"""scripts/draftprobe (diagnostic plugin, issue #19 item 4): the draft SWA
window's digest agrees between a PD prefill and decode exactly when the
draft's rows travelled.

Real 0.5.13 pools on CPU (the target ``DeepSeekV4TokenToKVPool`` with
compress ratios [0, 4, 128, 4], the SWA-only draft sharing the target
allocator's mapping, from ``test_dsv4_draft_swa``), allocated as each side
allocates: the prefill with ``SWATokenToKVPoolAllocator.alloc_extend`` (the
whole prompt in SWA), the decode with ``alloc_extend_swa_tail`` for the tail
``DecodePreallocQueue._swa_tail_len`` gives. The transfer is stood in for by
copying the SWA state rows page for page in the order both sides list them
(what Mooncake does with the two page lists).
"""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dataplane_fixtures import make_req
from test_dsv4_draft_swa import FULL, SWA, draft_pool, target_pool

PROBE_DIR = Path(__file__).resolve().parent.parent / "scripts" / "draftprobe"
WINDOW = 128  # DeepSeek-V4's sliding window
PROMPT = 600


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("hisparse_draftprobe", PROBE_DIR / "hisparse_draftprobe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one(v):
    return torch.tensor([v], dtype=torch.int64)


def _side():
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    target = target_pool()
    allocator = SWATokenToKVPoolAllocator(FULL, SWA, page_size=target.page_size, dtype=torch.uint8,
                                          device="cpu", kvcache=target, need_sort=False)
    return allocator, draft_pool(target)


def swa_tail_len(allocator, seq_len):
    """The release's own DecodePreallocQueue._swa_tail_len for this allocator."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    queue = SimpleNamespace(_uses_swa_tail_prealloc=lambda: True, token_to_kv_pool_allocator=allocator,
                            scheduler=SimpleNamespace(sliding_window_size=WINDOW))
    return DecodePreallocQueue._swa_tail_len(queue, seq_len)


def scheduler(allocator, draft, indices, role):
    """What the probe reads off a scheduler: its allocator, req_to_token
    (request slot 0 holds ``indices``), window and the PD queue's draft pool."""
    req_to_token = torch.zeros((2, 4096), dtype=torch.int32)
    req_to_token[0, : indices.numel()] = indices.to(torch.int32)
    queue = SimpleNamespace(draft_token_to_kv_pool=draft)
    return SimpleNamespace(token_to_kv_pool_allocator=allocator, sliding_window_size=WINDOW,
                           req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                           **{role: queue})


def request(room):
    req = make_req(f"r{room}", PROMPT)
    req.req_pool_idx, req.bootstrap_room, req.fill_len = 0, room, PROMPT
    return req


def pd_pair(probe, copy_draft: bool, stale: bool = False):
    """Prefill and decode records of one request; the draft's rows copied
    only if ``copy_draft`` (the registration), the target's always."""
    gen = torch.Generator().manual_seed(0)
    p_alloc, p_draft = _side()
    d_alloc, d_draft = _side()
    p_idx = p_alloc.alloc_extend(_one(0), _one(0), _one(PROMPT), _one(PROMPT), _one(-1), PROMPT)
    d_idx = d_alloc.alloc_extend_swa_tail(_one(0), _one(0), _one(PROMPT), _one(PROMPT), _one(-1), PROMPT,
                                          swa_tail_len=swa_tail_len(d_alloc, PROMPT))
    p_rows = probe.window_rows(p_idx, PROMPT, WINDOW, p_alloc.page_size, p_alloc.translate_loc_from_full_to_swa)
    d_rows = probe.window_rows(d_idx, PROMPT, WINDOW, d_alloc.page_size, d_alloc.translate_loc_from_full_to_swa)
    assert len(p_rows) == len(d_rows) > 0
    for pool in (p_draft, p_alloc.get_kvcache()):  # the prefill's forward wrote both
        for buf in pool.swa_kv_pool.kv_buffer:
            buf[torch.as_tensor(p_rows)] = torch.randint(0, 256, buf[torch.as_tensor(p_rows)].shape,
                                                         generator=gen, dtype=torch.uint8)
    if stale:  # an earlier request's window left in the decode's rows
        for buf in d_draft.swa_kv_pool.kv_buffer:
            buf[torch.as_tensor(d_rows)] = torch.randint(0, 256, buf[torch.as_tensor(d_rows)].shape,
                                                         generator=gen, dtype=torch.uint8)
    transfers = [(p_alloc.get_kvcache(), d_alloc.get_kvcache())] + ([(p_draft, d_draft)] if copy_draft else [])
    for src, dst in transfers:
        for s, d in zip(src.swa_kv_pool.kv_buffer, dst.swa_kv_pool.kv_buffer):
            d[torch.as_tensor(d_rows)] = s[torch.as_tensor(p_rows)]
    req = request(room=11)
    probe.probe_prefill(scheduler(p_alloc, p_draft, p_idx, "disagg_prefill_bootstrap_queue"), req)
    probe.probe_decode(scheduler(d_alloc, d_draft, d_idx, "disagg_decode_prealloc_queue"), [req])


def records(out):
    return [json.loads(line) for f in sorted(out.glob("draftprobe_*.jsonl")) for line in f.read_text().splitlines()]


@pytest.mark.parametrize("copy_draft, stale, equal", [(True, False, True), (True, True, True),
                                                      (False, False, False), (False, True, False)])
def test_digests_agree_exactly_when_the_draft_rows_travel(probe, tmp_path, monkeypatch, copy_draft, stale, equal):
    monkeypatch.setenv("DRAFTPROBE_OUT", str(tmp_path))
    pd_pair(probe, copy_draft, stale)
    lines = records(tmp_path)
    assert [r["side"] for r in lines] == ["prefill", "decode"]
    assert all(r["room"] == 11 and r["seq_len"] == PROMPT for r in lines)
    # The window's pages: from page_align_floor(600 - 128, 256) = 256 to 600, two pages.
    assert all(len(r["rows"]) == 2 for r in lines)
    assert (lines[0]["sha256"] == lines[1]["sha256"]) is equal


def test_nothing_is_recorded_without_a_v4_draft(probe, tmp_path, monkeypatch):
    """A server without a draft pool (or not DeepSeek-V4) writes nothing."""
    monkeypatch.setenv("DRAFTPROBE_OUT", str(tmp_path))
    alloc, _ = _side()
    idx = alloc.alloc_extend(_one(0), _one(0), _one(PROMPT), _one(PROMPT), _one(-1), PROMPT)
    probe.probe_prefill(scheduler(alloc, None, idx, "disagg_prefill_bootstrap_queue"), request(3))
    probe.probe_decode(scheduler(alloc, None, idx, "disagg_decode_prealloc_queue"), [request(3)])
    assert records(tmp_path) == []


def test_register_wraps_both_sides_only_when_asked(probe, tmp_path, monkeypatch):
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    send, pop = SchedulerDisaggregationPrefillMixin.send_kv_chunk, DecodeTransferQueue.pop_transferred
    monkeypatch.setattr(SchedulerDisaggregationPrefillMixin, "send_kv_chunk", send)
    monkeypatch.setattr(DecodeTransferQueue, "pop_transferred", pop)
    monkeypatch.delenv("DRAFTPROBE_OUT", raising=False)
    probe.register()
    assert SchedulerDisaggregationPrefillMixin.send_kv_chunk is send
    monkeypatch.setenv("DRAFTPROBE_OUT", str(tmp_path / "out"))
    probe.register()
    assert SchedulerDisaggregationPrefillMixin.send_kv_chunk is not send
    assert DecodeTransferQueue.pop_transferred is not pop
    # The wrapped decode side hands back what the release returned, probed or not.
    queue = SimpleNamespace(scheduler=SimpleNamespace(), queue=[])
    assert DecodeTransferQueue.pop_transferred(queue) == []
    meta = (PROBE_DIR / "hisparse_draftprobe-0.1.dist-info" / "entry_points.txt").read_text()
    assert "[sglang.srt.plugins]" in meta and "hisparse_draftprobe:register" in meta
