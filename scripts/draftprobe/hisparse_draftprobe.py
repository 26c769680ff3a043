"""Diagnostic SGLang plugin: does a DeepSeek-V4 draft's SWA window reach the decode?

Not part of sglang-hisparse. Issue #19 item 4 asks for proof, in a PD pair
where both sides run EAGLE/MTP on DeepSeek-V4, that the decode starts with
the prefill's draft (NextN) sliding-window KV: 0.5.13 leaves the draft's SWA
buffers out of the transfer and our manifest entry
``disaggregation.utils.setup_state_kv_args`` adds them.

Put this folder on a server's PYTHONPATH (its dist-info makes it an entry
point of ``sglang.srt.plugins``) and set DRAFTPROBE_OUT to a directory. Each
scheduler process then appends one JSON line per request to
DRAFTPROBE_OUT/draftprobe_<pid>.jsonl:

* prefill (``send_kv_chunk`` with ``last_chunk``, before the send): the
  SHA-256 of the draft pool's SWA rows that the SWA state component moves
  for this request, every draft layer in order;
* decode (after ``DecodeTransferQueue.pop_transferred``: the transfer has
  landed and the request has not run a step): the same rows of its own
  draft pool, at its own indices.

The rows are the ones both sides' ``_swa_payload`` (a closure inside
``send_kv_chunk`` / the prealloc queue, so not callable from here) sends:
the window's pages from ``page_align_floor(seq_len - window)`` to
``seq_len``, through the target allocator's full-to-SWA mapping (the draft
shares it), as page ids of the allocator's page size. A transfer moves whole
rows, so with the registration the two digests of a request (matched by
``bootstrap_room``) are equal; without it the decode's rows are whatever
its pool held, and they differ.

Nothing happens unless DRAFTPROBE_OUT is set and both the target's and the
draft's pools are ``DeepSeekV4TokenToKVPool``; an error is logged, never
raised (a diagnostic must not take the server down). It synchronizes the
GPU once per request: never time a server that loads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

logger = logging.getLogger(__name__)
_lock = threading.Lock()


def window_rows(req_to_token_row, seq_len: int, window_size: int, page_size: int, translate):
    """The SWA rows (page ids) the SWA state component moves for a request of
    ``seq_len`` prompt tokens: ``translate`` maps full KV indices to SWA ones
    (the target allocator's ``translate_loc_from_full_to_swa``)."""
    from sglang.srt.mem_cache.common import kv_to_page_indices

    start = max(0, seq_len - window_size) // page_size * page_size
    full = req_to_token_row[start:seq_len]
    # 0.5.13's kv_to_page_indices is given a NumPy array, 0.5.17's a tensor
    # (it converts): a tensor works in both, and the result is made NumPy here.
    pages = kv_to_page_indices(translate(full), page_size)
    return pages.cpu().numpy() if hasattr(pages, "cpu") else pages


def draft_swa_digest(draft_pool, rows) -> str:
    """SHA-256 of ``rows`` of every layer of the draft's SWA buffer, in layer order."""
    import torch

    digest = hashlib.sha256()
    for buf in draft_pool.swa_kv_pool.kv_buffer:
        index = torch.as_tensor(rows, dtype=torch.long, device=buf.device)
        digest.update(buf.index_select(0, index).cpu().numpy().tobytes())
    return digest.hexdigest()


def request_record(side: str, req, *, req_to_token, allocator, draft_pool, window_size: int) -> dict:
    """One request's line: its room, its prompt length and the digest."""
    seq_len = len(req.origin_input_ids)
    if side == "prefill":
        seq_len = min(req.fill_len, seq_len)  # what send_kv_chunk sends
    rows = window_rows(req_to_token[req.req_pool_idx], seq_len, window_size,
                       allocator.page_size, allocator.translate_loc_from_full_to_swa)
    return dict(side=side, room=req.bootstrap_room, rid=req.rid, seq_len=seq_len,
                rows=[int(r) for r in rows], sha256=draft_swa_digest(draft_pool, rows))


def _write(record: dict) -> None:
    path = os.path.join(os.environ["DRAFTPROBE_OUT"], f"draftprobe_{os.getpid()}.jsonl")
    with _lock, open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _both_v4(target, draft) -> bool:
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return isinstance(target, DeepSeekV4TokenToKVPool) and isinstance(draft, DeepSeekV4TokenToKVPool)


def _sync(draft_pool) -> None:
    import torch

    if draft_pool.swa_kv_pool.kv_buffer[0].is_cuda:
        torch.cuda.synchronize()


def probe_prefill(scheduler, req) -> None:
    draft = scheduler.disagg_prefill_bootstrap_queue.draft_token_to_kv_pool
    if not _both_v4(scheduler.token_to_kv_pool_allocator.get_kvcache(), draft):
        return
    _sync(draft)
    _write(request_record("prefill", req, req_to_token=scheduler.req_to_token_pool.req_to_token,
                          allocator=scheduler.token_to_kv_pool_allocator, draft_pool=draft,
                          window_size=scheduler.sliding_window_size))


def probe_decode(scheduler, reqs) -> None:
    if not reqs:
        return
    draft = scheduler.disagg_decode_prealloc_queue.draft_token_to_kv_pool
    if not _both_v4(scheduler.token_to_kv_pool_allocator.get_kvcache(), draft):
        return
    _sync(draft)
    for req in reqs:
        _write(request_record("decode", req, req_to_token=scheduler.req_to_token_pool.req_to_token,
                              allocator=scheduler.token_to_kv_pool_allocator, draft_pool=draft,
                              window_size=scheduler.sliding_window_size))


def _guarded(probe, *args) -> None:
    try:
        probe(*args)
    except Exception:  # a diagnostic must never take the server down
        logger.exception("draftprobe failed")


def register() -> None:
    if not os.environ.get("DRAFTPROBE_OUT"):
        return
    os.makedirs(os.environ["DRAFTPROBE_OUT"], exist_ok=True)
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    send_kv_chunk = SchedulerDisaggregationPrefillMixin.send_kv_chunk
    pop_transferred = DecodeTransferQueue.pop_transferred

    def probed_send_kv_chunk(self, req, last_chunk=False, end_idx=None):
        if last_chunk:  # before the send: the rows as they leave
            _guarded(probe_prefill, self, req)
        return send_kv_chunk(self, req, last_chunk=last_chunk, end_idx=end_idx)

    def probed_pop_transferred(self, *args, **kwargs):
        reqs = pop_transferred(self, *args, **kwargs)
        _guarded(probe_decode, self.scheduler, reqs)
        return reqs

    SchedulerDisaggregationPrefillMixin.send_kv_chunk = probed_send_kv_chunk
    DecodeTransferQueue.pop_transferred = probed_pop_transferred

