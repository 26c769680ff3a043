"""The two ends of a PD KV transfer, each in its own process, for
tests/test_pd_transfer.py: ``python tests/pd_transfer_peers.py prefill|decode``.

Both use the real Mooncake transfer engine through SGLang's own wrapper
(``MooncakeTransferEngine``, as ``MooncakeKVManager.init_engine`` gets it),
over TCP on 127.0.0.1 with ``P2PHANDSHAKE``, and register their buffers with
0.5.13's own ``MooncakeKVManager.register_buffer_to_engine``:

* prefill: 0.5.13's ``DSATokenToKVPool`` (what a prefill server's KV lives
  in, here on the CPU) registered as the prefill registers it
  (``get_contiguous_buf_infos``: one page of 64 rows per item); it sends with
  0.5.13's own ``MooncakeKVManager.send_kvcache``, which computes every
  source and destination address (``_send_kvcache_generic``);
* decode: our ``HiSparseMLAHostPool`` as a HiSparse decode builds and
  registers it (``coordinator.mem_pool_host``, decode.py:392-399), the host
  rows chosen by 0.5.13's own ``DecodePreallocQueue._pre_alloc`` and turned
  into the page indices the decode sends the prefill as decode.py:957-966 and
  1030 do.

The ``MooncakeKVManager`` methods run unbound on a namespace holding what
they read, like the ``_pre_alloc`` of dataplane_fixtures: the manager itself
starts a bootstrap server and needs SGLang's process groups.

Protocol: each peer writes ``PEER <json>`` lines on stdout and reads JSON
lines on stdin (the test relays the decode's registration to the prefill).
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from types import MethodType, SimpleNamespace

# The transport SGLang uses for --disaggregation-transfer-backend mooncake_tcp
# (MC_FORCE_TCP=1, pd_disaggregation_hook.py:18-21; MOONCAKE_PROTOCOL is what
# MooncakeTransferEngine.initialize passes).
os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dataplane_fixtures import PS, dsa_pool, make_req, pre_alloc, req_pool, t64  # noqa: E402

HOST = "127.0.0.1"
DEVICE_ROWS = 1024
PROMPT = 300  # 4 whole pages and 44 rows of a fifth
# Where the prefill's allocator put the prompt's pages, and the host pages
# the decode has free when the request arrives, in free-list order: neither
# contiguous nor in order, so every page's address is computed on its own.
PREFILL_PAGES = [9, 2, 13, 5, 1]
HOST_FREE_PAGES = [21, 4, 17, 9, 30]
FILL_PREFILL, FILL_HOST = 0x3C, 0xA5  # every other row of each side
TOPK, HOT = 16, 128


def say(**msg):
    print("PEER " + json.dumps(msg), flush=True)


def listen() -> dict:
    return json.loads(sys.stdin.readline())


def kv_pattern(layer: int, rows: int, row_bytes: int) -> torch.Tensor:
    """The prompt's KV bytes of one layer, position by position (both peers
    compute it; the decode checks what landed against its own copy)."""
    g = torch.Generator().manual_seed(1000 + layer)
    return torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def page_rows(pages) -> torch.Tensor:
    return (t64(*pages)[:, None] * PS + torch.arange(PS)).reshape(-1)


def engine():
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    return MooncakeTransferEngine(hostname=HOST, gpu_id=0, ib_device=None)


def kv_args(ptrs, lens, item_lens):
    """0.5.13's Mooncake KVArgs, filled as _init_kv_manager fills it (no aux
    or state buffers: only the latent KV is under test)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    args = get_kv_class(TransferBackend.MOONCAKE, KVClassType.KVARGS)()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = ptrs, lens, item_lens
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
    args.page_size = PS
    args.prefill_start_layer = 0
    args.kv_layer_ids = []  # 0.5.17 reads it (decode.py _init_kv_manager: [] without layer ids)
    return args


def kv_manager(args, te):
    """``self`` for MooncakeKVManager's registration and send methods."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    mgr = SimpleNamespace(kv_args=args, engine=te, is_mla_backend=True,
                          enable_custom_mem_pool=False)
    for name in ("register_buffer_to_engine", "send_kvcache", "_send_kvcache_generic",
                 "_transfer_data", "get_mla_kv_ptrs_with_pp"):
        setattr(mgr, name, MethodType(getattr(MooncakeKVManager, name), mgr))
    return mgr


def decode():
    from sglang.srt.mem_cache.common import kv_to_page_indices

    from sglang_hisparse.adapter.model_runner import HiSparseCoordinator
    from sglang_hisparse.pools.allocator import HiSparseDualAllocator

    pool = dsa_pool(DEVICE_ROWS)
    r2t = req_pool(8, 2048)
    alloc = HiSparseDualAllocator(DEVICE_ROWS, PS, torch.bfloat16, "cpu", pool, False, 2)
    coord = HiSparseCoordinator(r2t, alloc, TOPK, HOT, "cpu", None, 2,
                                swap_in_block_size=1024, pd_decode=True)
    host = coord.mem_pool_host
    # Other requests hold every host page but these (freed in this order).
    held = host.alloc_page(host.free_page_count())
    assert held is not None and max(HOST_FREE_PAGES) < host.num_pages
    for page in HOST_FREE_PAGES:
        host.free(t64(page * PS))
    for layer in range(host.layer_num):
        host.layer_rows(layer).fill_(FILL_HOST)

    req = make_req("pd", PROMPT)
    host_rows = pre_alloc(r2t, alloc, coord, req)  # 0.5.13's _pre_alloc
    # decode.py:957-966, 1030: the host rows of the prompt, as pages.
    # (a tensor: 0.5.17's kv_to_page_indices takes one and returns numpy,
    # 0.5.13's indexes whatever it gets)
    page_size = getattr(alloc, "hisparse_page_size", PS)
    dst_pages = kv_to_page_indices(host_rows[:PROMPT].to(torch.int32), page_size)

    te = engine()
    ptrs, lens, item_lens = host.get_contiguous_buf_infos()
    kv_manager(kv_args(ptrs, lens, item_lens), te).register_buffer_to_engine()
    say(session_id=te.session_id, dst_kv_ptrs=ptrs, dst_item_lens=item_lens,
        dst_pages=[int(p) for p in dst_pages], host_pages=host.num_pages,
        free_pages=HOST_FREE_PAGES)

    listen()  # the prefill has sent
    # Checked where the decode will read position p: its request's host row
    # (req_to_host_pool, whole pages), not the page list that was sent.
    idx = req.req_pool_idx
    rows = coord.req_to_host_pool[idx, :int(coord.req_to_host_pool_allocated_len[idx])].cpu()
    landed, elsewhere = [], []
    others = torch.ones(host.size, dtype=torch.bool)
    others[rows] = False
    for layer in range(host.layer_num):
        got = host.layer_rows(layer)
        want = kv_pattern(layer, rows.numel(), host.item_bytes)
        landed.append(bool(torch.equal(got[rows], want)))
        elsewhere.append(int((got[others] != FILL_HOST).any(dim=1).sum()))
    say(landed=landed, rows_changed_elsewhere=elsewhere)


def prefill():
    from sglang.srt.mem_cache.common import kv_to_page_indices

    pool = dsa_pool(DEVICE_ROWS)  # 0.5.13 DSATokenToKVPool
    rows = page_rows(PREFILL_PAGES)
    for layer in range(pool.layer_num):
        layer_rows = byte_rows(pool.kv_buffer[layer])
        layer_rows.fill_(FILL_PREFILL)
        layer_rows[rows] = kv_pattern(layer, rows.numel(), layer_rows.shape[1])

    te = engine()
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    mgr = kv_manager(kv_args(ptrs, lens, item_lens), te)
    mgr.register_buffer_to_engine()
    say(session_id=te.session_id, src_item_lens=item_lens)

    dst = listen()
    # prefill.py:999 (send_kv_chunk): the prompt's device rows, as pages.
    src_pages = np.asarray(kv_to_page_indices(rows[:PROMPT].to(torch.int32), PS), dtype=np.int32)
    with ThreadPoolExecutor(1) as executor:
        ret = mgr.send_kvcache(dst["session_id"], src_pages, dst["dst_kv_ptrs"],
                               np.asarray(dst["dst_pages"], dtype=np.int32), executor)
        # A page past the end of the decode's registered host memory: the
        # engine must refuse it (a nonzero status is what a failed send returns).
        # (The host pool is one buffer, layer after layer, registered as one
        # segment per layer: the engine checks an address against all of them,
        # so one page past layer 0 would land in layer 1's first page.)
        beyond = np.asarray([dst["host_pages"] * len(dst["dst_kv_ptrs"])], dtype=np.int32)
        ret_beyond = mgr.send_kvcache(dst["session_id"], src_pages[:1], dst["dst_kv_ptrs"],
                                      beyond, executor)
    say(ret=int(ret), ret_beyond=int(ret_beyond))


if __name__ == "__main__":
    {"prefill": prefill, "decode": decode}[sys.argv[1]]()
    # The engine's threads may outlive main; nothing else is left to do.
    sys.stdout.flush()
    os._exit(0)
