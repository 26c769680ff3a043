"""Real SGLang 0.5.13 pools on CPU for the data-plane tests (allocator, host
pool, coordinator). Only Req objects are SGLang's own too; nothing is mocked."""

import os
from array import array

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

PS = 64
LAYERS = 2


def dsa_pool(size=1024, layers=LAYERS, dtype=torch.bfloat16, kv_cache_dim=576):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=size, page_size=PS, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64,
        layer_num=layers, device="cpu", index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,
    )


def req_pool(size=8, max_ctx=2048):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(size=size, max_context_len=max_ctx, device="cpu",
                          enable_memory_saver=False)


def make_req(rid, n):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("i", [1] * n), SamplingParams(max_new_tokens=16))


def t64(*v):
    return torch.tensor(list(v), dtype=torch.int64)


def prefill(r2t, alloc, req, n, pool=None, tag=None):
    """Allocate a request slot and its prompt like alloc_for_extend does."""
    (idx,) = r2t.alloc([req])
    req.req_pool_idx = idx
    out = alloc.alloc_extend(t64(0), t64(0), t64(n), t64(n), t64(-1), n)
    assert out is not None
    r2t.req_to_token[idx, :n] = out.to(torch.int32)
    req.fill_len = req.kv_allocated_len = n
    if pool is not None:
        rows = alloc.translate_to_physical(out)
        for layer in range(pool.layer_num):
            put_tag(pool.kv_buffer[layer], rows, torch.arange(n))
            pool.kv_buffer[layer][rows, 0, 1] = float(layer + 1)
    return out


def decode_step(r2t, alloc, coord, reqs):
    """One decode step up to the forward pass: a new slot per request as
    alloc_for_decode makes it, then the coordinator's map_last_loc_to_buffer
    (0.5.13 passes no CPU indices). Returns (req_pool_indices, new seq_lens,
    new logical slots)."""
    rpi = t64(*[r.req_pool_idx for r in reqs])
    seq = t64(*[r.kv_allocated_len for r in reqs])
    last = r2t.req_to_token[rpi, seq - 1].to(torch.int64)
    out = alloc.alloc_decode(seq + 1, seq + 1, last)
    r2t.req_to_token[rpi, seq] = out.to(torch.int32)
    for r in reqs:
        r.kv_allocated_len += 1
    seq = seq + 1
    coord.map_last_loc_to_buffer(seq, out, rpi, seq.clone(), None)
    return rpi, seq, out


def release(r2t, alloc, req):
    """release_kv_cache for a radix-free cache."""
    alloc.free(r2t.req_to_token[req.req_pool_idx, : req.kv_allocated_len].to(torch.int64))
    r2t.free(req)
    req.req_pool_idx = None


def free_counts(alloc, host=None, r2t=None):
    d = dict(logical=alloc.logical_available_size(), physical=alloc.physical_available_size())
    if host is not None:
        d["host"] = host.available_size()
    if r2t is not None:
        d["req"] = r2t.available_size()
    return d


def put_tag(buf, rows, toks):
    """Token ids into bf16 rows exactly (two small integers per row)."""
    toks = torch.as_tensor(toks, dtype=torch.int64)
    buf[rows, 0, 0] = (toks % 128).to(buf.dtype)
    buf[rows, 0, 2] = (toks // 128).to(buf.dtype)


def get_tag(buf, rows):
    rows = torch.as_tensor(rows, dtype=torch.int64)
    return (buf[rows, 0, 0].float() + 128 * buf[rows, 0, 2].float()).long().tolist()
