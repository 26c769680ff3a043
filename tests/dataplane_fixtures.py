"""Real SGLang 0.5.13 pools on CPU for the data-plane tests (allocator, host
pool, coordinator), and SGLang's own functions for what the scheduler does
around them: ``ScheduleBatch.prepare_for_decode`` (``alloc_for_decode``, then
the coordinator's ``map_last_loc_to_buffer``), ``release_kv_cache`` through a
real ``ChunkCache``, ``DecodePreallocQueue._pre_alloc`` and
``Scheduler.abort_request``. The last two are called unbound, their ``self`` a
namespace holding what they read (the queue and the scheduler cannot be built
without a GPU, a transfer engine and a process group); nothing is mocked.

``scripts/soak.py`` imports these helpers too (``device`` picks cpu or cuda).
"""

import contextlib
import functools
import inspect
import os
from array import array
from pathlib import Path
from types import MethodType, SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from sglang_hisparse.adapter import releases

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

    # token ids as an array("q"), as the tokenizer manager sends them
    return Req(rid, "", array("q", [1] * n), SamplingParams(max_new_tokens=16))


# Where the installed release keeps a request's allocated KV length.
kv_allocated_len = releases.current.kv_allocated_len
set_kv_allocated_len = releases.current.set_kv_allocated_len


def scheduler_passes_batches() -> bool:
    """Whether the installed release's ``Scheduler.get_next_batch_to_run`` /
    ``get_new_batch_prefill`` take the running batch and return a
    ``NextBatchPlan`` (0.5.17) rather than read ``self.running_batch`` and
    return the batch (read from its source: importing the scheduler is slow)."""
    from sglang_hisparse.pinned_source import read_pinned_source

    text = read_pinned_source("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill").text
    return "running_batch" in text.split(")", 1)[0]


def t64(*v):
    return torch.tensor(list(v), dtype=torch.int64)


def prefill(r2t, alloc, req, n, pool=None, tag=None):
    """Allocate a request slot and its prompt like alloc_for_extend does."""
    (idx,) = r2t.alloc([req])
    req.req_pool_idx = idx
    out = alloc.alloc_extend(t64(0), t64(0), t64(n), t64(n), t64(-1), n)
    assert out is not None
    r2t.req_to_token[idx, :n] = out.to(torch.int32)
    # as the prefill scheduler and ScheduleBatch.prepare_for_extend leave a
    # fully prefilled request (the release names the prefill range its way)
    releases.current.set_prefill_range(req, 0, n)
    req.kv_committed_len = n
    set_kv_allocated_len(req, n)
    if pool is not None:
        rows = alloc.translate_to_physical(out)
        for layer in range(pool.layer_num):
            put_tag(pool.kv_buffer[layer], rows, torch.arange(n))
            pool.kv_buffer[layer][rows, 0, 1] = float(layer + 1)
    return out


TINY_MODEL = Path(__file__).resolve().parent / "data" / "tiny-dsv32"


@functools.lru_cache(maxsize=None)
def model_config():
    """SGLang's ModelConfig of the config-only DeepSeek-V3.2 (what a batch reads)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(str(TINY_MODEL))


@functools.lru_cache(maxsize=None)
def _default_server_args():
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy")
    args.page_size = PS
    return args


@functools.lru_cache(maxsize=None)
def _server_args_without_tokenizer():
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", skip_tokenizer_init=True)


@contextlib.contextmanager
def decode_node_server_args(page_size: int):
    """A fresh ServerArgs of a PD decode node with ``page_size``, installed
    as the process-wide one (what ``release_kv_cache`` and the PD queues
    read) for the block."""
    from sglang.srt import server_args as sa

    args = sa.ServerArgs(model_path="dummy")
    args.page_size, args.disaggregation_mode = page_size, "decode"
    with installed_server_args(args):
        yield args


@contextlib.contextmanager
def installed_server_args(args):
    """``args`` as SGLang's process-wide ServerArgs (``get_global_server_args``)
    for the block; whatever was installed before (or nothing) after it."""
    from sglang.srt import server_args as sa

    try:
        before = sa.get_global_server_args()
    except ValueError:
        before = None
    sa.set_global_server_args_for_scheduler(args)
    try:
        yield args
    finally:
        sa.set_global_server_args_for_scheduler(before)


def dsv4_pool(*, compression_ratios, swa_size, c4_size=0, c128_size=0, state_pool_size=0,
              page_size=256, swa_page_size=256, enable_hisparse=False):
    """A real ``DeepSeekV4TokenToKVPool`` on CPU: one layer per compress ratio,
    fp8 KV as uint8, fp32 compress states, DeepSeek-V4's head dims. The
    defaults are what 0.5.13's model runner gives a draft (NextN) pool: page
    256 for both the full and the SWA pages, no C4, C128 or state pool."""
    import inspect

    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.server_args import ServerArgs

    # One state dtype (0.5.13) or one per compressed state pool (0.5.15): as
    # the release's own constructor names it.
    params = inspect.signature(DeepSeekV4TokenToKVPool.__init__).parameters
    state_dtypes = ({"state_dtype": torch.float32} if "state_dtype" in params else
                    {"c4_state_dtype": torch.float32, "c128_state_dtype": torch.float32})
    # The pool reads the process-wide server args (ring sizes, fp4 indexer)
    # while it is built.
    with installed_server_args(ServerArgs(model_path="dummy")):
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=8, swa_size=swa_size, c4_size=c4_size, c128_size=c128_size,
            c4_state_pool_size=state_pool_size, c128_state_pool_size=state_pool_size,
            page_size=page_size, swa_page_size=swa_page_size, dtype=torch.uint8,
            **state_dtypes, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
            layer_num=len(compression_ratios), device="cpu", enable_memory_saver=False,
            compression_ratios=list(compression_ratios), enable_hisparse=enable_hisparse,
        )


@contextlib.contextmanager
def our_c4_pool_as_native():
    """The native ``HiSparseC4DevicePool`` name pointed at ours for the block,
    the way the class REPLACE does it (a HiSparse pool built inside gets ours)."""
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as dsv4_pool_mod

    from sglang_hisparse.pools.device_c4 import DSV4C4DevicePool

    saved = dsv4_pool_mod.HiSparseC4DevicePool
    dsv4_pool_mod.HiSparseC4DevicePool = DSV4C4DevicePool
    try:
        yield
    finally:
        dsv4_pool_mod.HiSparseC4DevicePool = saved


def speculative_server_args():
    """The default ServerArgs as a speculative (EAGLE) server resolves them:
    release_kv_cache then frees the spec reserve past the committed length
    instead of asserting there is none."""
    import copy

    args = copy.copy(_default_server_args())
    args.speculative_algorithm = "EAGLE"
    # DeepSeek-V3.2's defaults: 3 steps, top-k 1, 4 draft tokens.
    args.speculative_num_steps, args.speculative_eagle_topk = 3, 1
    args.speculative_num_draft_tokens = 4
    return installed_server_args(args)


@contextlib.contextmanager
def sglang_server_args():
    """SGLang's batch and cache functions read the process-wide ServerArgs.
    Where no test installed one, a default one (page size 64) is installed
    for the block and removed after it."""
    from sglang.srt import server_args as sa

    try:
        args = sa.get_global_server_args()
    except ValueError:
        args = None
    if args is not None:
        yield args
        return
    with installed_server_args(_default_server_args()) as args:
        yield args


def chunk_cache(r2t, alloc):
    """The tree cache of a server without radix cache (and of a PD decode node)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    return ChunkCache(CacheInitParams(disable=True, req_to_token_pool=r2t,
                                      token_to_kv_pool_allocator=alloc, page_size=alloc.page_size))


def decode_batch(r2t, alloc, coord, reqs, device="cpu"):
    """The running batch of ``reqs`` as the scheduler holds it before a decode
    step: seq_lens = tokens whose KV exists."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rpi = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    seq = torch.tensor([kv_allocated_len(r) for r in reqs], dtype=torch.int64)
    batch = ScheduleBatch(
        reqs=list(reqs), req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
        tree_cache=chunk_cache(r2t, alloc), model_config=model_config(), device=device,
        hisparse_coordinator=coord, spec_algorithm=SpeculativeAlgorithm.NONE,
        req_pool_indices=rpi.to(device), req_pool_indices_cpu=rpi,
        seq_lens=seq.to(device), seq_lens_cpu=seq.clone(),
        orig_seq_lens=seq.to(device=device, dtype=torch.int32))
    with sglang_server_args():
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
            batch, model_config().vocab_size)
    return batch


def decode_step(r2t, alloc, coord, reqs, device="cpu"):
    """One decode step up to the forward pass: 0.5.13's own
    ``ScheduleBatch.prepare_for_decode`` (``alloc_for_decode``, the request's
    KV lengths + 1, then the coordinator's ``map_last_loc_to_buffer``).
    Returns (req_pool_indices, new seq_lens, new logical slots)."""
    batch = decode_batch(r2t, alloc, coord, reqs, device)
    with sglang_server_args():
        batch.prepare_for_decode()
    return batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc


def verify_locs(r2t, reqs, committed, n):
    """The logical slots a verify step writes: positions ``S .. S + n - 1``
    of each request, from req_to_token ([len(reqs), n] int64, request-major
    as 0.5.13's verify ``out_cache_loc``)."""
    return torch.stack([r2t.req_to_token[r.req_pool_idx, s:s + n].to(torch.int64)
                        for r, s in zip(reqs, committed)])


def release(r2t, alloc, req):
    """0.5.13 ``release_kv_cache`` through a ChunkCache (no radix cache): the
    request's KV slots and its request slot."""
    from sglang.srt.mem_cache.common import release_kv_cache

    with sglang_server_args():
        release_kv_cache(req, chunk_cache(r2t, alloc))


def prealloc_queue(r2t, alloc, coord, server_args=None):
    """``self`` for ``DecodePreallocQueue`` methods on a HiSparse PD decode
    node: what ``_pre_alloc`` reads, with its helper bound."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    if server_args is None:
        server_args = _default_server_args()
    queue = SimpleNamespace(
        req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
        tree_cache=chunk_cache(r2t, alloc),
        scheduler=SimpleNamespace(enable_hisparse=True, hisparse_coordinator=coord,
                                  server_args=server_args),
        queue=[], retracted_queue=[])
    # _pre_alloc's helpers, the release's own, bound to the stand-in (0.5.17
    # added the fill length and SWA-tail ones; a static one stays unbound).
    for name in ("_required_alloc_tokens", "_pre_alloc_fill_len", "_uses_swa_tail_prealloc",
                 "_swa_tail_len"):
        if not hasattr(DecodePreallocQueue, name):
            continue
        helper = inspect.getattr_static(DecodePreallocQueue, name)
        setattr(queue, name, helper.__func__ if isinstance(helper, staticmethod)
                else MethodType(helper, queue))
    queue.token_to_kv_pool = alloc.get_kvcache()  # what _uses_swa_tail_prealloc asks
    queue.scheduler.sliding_window_size = None
    return queue


@functools.lru_cache(maxsize=None)
def patched_pre_alloc():
    """``DecodePreallocQueue._pre_alloc`` as the plugin installs it: the
    release's own source with our manifest's patch applied and compiled in
    its module (host rows from ``coordinator.prealloc_host_rows``)."""
    from sglang_hisparse.manifest import ENTRIES
    from sglang_hisparse.pinned_source import sglang_version
    from sglang_hisparse.plugin import check_entry

    (entry,) = [e for e in ENTRIES
                if e.target == "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc"]
    check = check_entry(entry, sglang_version())
    assert check.ok, check.detail
    return check.hook


def pre_alloc(r2t, alloc, coord, req, queue=None):
    """The patched ``DecodePreallocQueue._pre_alloc`` (its HiSparse branch): a
    request slot, logical slots only, host rows for the transfer (or, after
    retraction, the rows the request kept). Returns the host rows."""
    with sglang_server_args():
        return patched_pre_alloc()(queue or prealloc_queue(r2t, alloc, coord), req)


class _RecordingSocket:
    """The zmq socket behind SGLang's SenderWrapper: keeps what is sent."""

    def __init__(self):
        self.sent = []

    def send_pyobj(self, obj, flags=0, protocol=None):
        # (0.5.15 sends through sock_send, which passes zmq flags and the
        # pickle protocol)
        self.sent.append(obj)


def abort_scheduler(coord, r2t, alloc, *, decode, waiting=(), retracted=(), running=()):
    """``self`` for 0.5.13 ``Scheduler.abort_request``: every attribute it
    (and our AROUND hook) reads, real SGLang objects where they can be built
    (ChunkCache, GrammarManager, ScheduleBatch, SenderWrapper). Returns
    (scheduler, the list of outputs sent to the tokenizer)."""
    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels
    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper

    socket = _RecordingSocket()
    # (its grammar queue is empty: no backend, one rank)
    grammar = GrammarManager(SimpleNamespace(
        server_args=_server_args_without_tokenizer(), dp_tp_cpu_group=None,
        dp_tp_group=SimpleNamespace(world_size=1, first_rank=0, is_first_rank=True),
        ps=SimpleNamespace(pp_rank=0, pp_size=1), pp_group=None))  # 0.5.17: GrammarManager reads PP
    queue = prealloc_queue(r2t, alloc, coord)
    queue.retracted_queue = list(retracted)
    scheduler = SimpleNamespace(
        hisparse_coordinator=coord, enable_hisparse=True,
        disaggregation_mode=DisaggregationMode.DECODE if decode else DisaggregationMode.NULL,
        waiting_queue=list(waiting), enable_hicache_storage=False, chunked_req=None,
        tree_cache=chunk_cache(r2t, alloc), grammar_manager=grammar,
        ipc_channels=SchedulerIpcChannels(
            recv_from_tokenizer=None, recv_from_rpc=None, send_to_tokenizer=SenderWrapper(socket),
            send_to_detokenizer=SenderWrapper(None), send_metrics_from_scheduler=None),
        disagg_decode_prealloc_queue=queue,
        disagg_decode_transfer_queue=SimpleNamespace(queue=[]),
        running_batch=ScheduleBatch(reqs=list(running)), cur_batch=None,
        # 0.5.17's abort_request also reads these (the PP and dLLM queues)
        ps=SimpleNamespace(pp_size=1), last_batch=None, dllm_config=None)
    return scheduler, socket.sent


def abort(scheduler, rid):
    """An AbortReq through our AROUND hook wrapped around 0.5.13's own
    ``Scheduler.abort_request`` (called unbound on ``scheduler``)."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_hisparse.adapter.scheduler import scheduler_abort_request

    with sglang_server_args():
        scheduler_abort_request(Scheduler.abort_request, scheduler, AbortReq(rid=rid))


def drained(env) -> bool:
    """Every slot back: ``env.counts()`` equals ``env.start``, the coordinator
    holds no request slot, and no logical id maps to a device row."""
    return (env.counts() == env.start and not env.coord.live_request_slots()
            and int(env.alloc.full_to_hisparse_device_index_mapping[:-1].abs().sum()) == 0)


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
