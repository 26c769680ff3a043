"""IndexShare prefetch on the GPU (needs CUDA): the engine's prefetch
(``engine/prefetch.py``) driving the JIT swap-in and copy-only kernels.

* the replay of the anchor's plan on every shared layer's pools is byte for
  byte the torch reference's synchronous swap-in of that layer (and so are
  the outputs it reuses), on the prefetch stream with one event per layer;
* the same under CUDA-graph capture (anchor swap-in, the replays' fork onto
  the prefetch stream and the shared layers' waits captured; the top-k and
  the real-row count change between replays);
* a race test: with a slow host link emulated on the prefetch stream (it
  spins before each replay) and every entry missing, a shared layer's read
  right after its wait always sees its own bytes; the same read without the
  wait sees stale rows (the test can fail).

Every test draws fresh random inputs (the seed is in each failure message;
HISPARSE_TEST_SEED replays one).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernel_cases import graph_case, make_case, refresh_top_k
from sglang_hisparse.engine.index_share import LayerRoles
from sglang_hisparse.engine.prefetch import IndexSharePrefetch, ReplayGrid
from sglang_hisparse.engine.streams import Streams
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels import swap_in as swap_mod
from sglang_hisparse.kernels.copy_planned import copy_planned_selected

pytestmark = pytest.mark.gpu

PAGE = 64


def _seed() -> int:
    fixed = os.environ.get("HISPARSE_TEST_SEED")
    return int(fixed) if fixed else random.SystemRandom().randrange(1 << 30)


class Layers:
    """An anchor (layer 0) and its shared layers 1..n: one slot table, each
    layer its own pinned host pool and device pool; a CPU twin of every
    layer for the reference."""

    def __init__(self, case, shared: int, seed: int, grid: ReplayGrid = ReplayGrid(),
                 high_priority: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.want = [case.clone()]
        for _ in range(shared):
            w = case.clone()
            w.host_kv = torch.randint(0, 256, case.host_kv.shape, dtype=torch.uint8, generator=gen)
            w.device_kv = torch.randint(0, 256, case.device_kv.shape, dtype=torch.uint8,
                                        generator=gen)
            self.want.append(w)
        self.gpu = [w.clone("cuda", pin_host=True) for w in self.want]
        self.roles = LayerRoles.from_pattern("F" + "S" * shared)
        bs, top_k = case.top_k_tokens.shape
        self.streams = Streams("cuda", prefetch_high_priority=high_priority)
        assert self.streams.prefetch.priority == (-1 if high_priority else 0)
        self.prefetch = IndexSharePrefetch(self.roles, max_requests=bs + 4, plan_width=top_k,
                                           device="cuda", streams=self.streams, grid=grid)
        self.workspace = torch.zeros(bs, dtype=torch.int32, device="cuda")

    def pools(self, layer):
        return self.gpu[layer].host_kv, self.gpu[layer].device_kv

    def gpu_step(self, wait: bool = True) -> list:
        """Anchor swap-in + replays; each shared layer's rows at the anchor's
        output gathered right after its wait (the attention's reads)."""
        a = self.gpu[0]
        bs = a.top_k_tokens.size(0)
        self.prefetch.before_anchor()
        swap_mod.swap_in(*a.args(), **self.prefetch.plan(bs), workspace=self.workspace)
        self.prefetch.replay_followers(0, bs, a.num_real_reqs, self.pools, "rows",
                                       copy_planned_selected)
        reads = []
        rows = a.out.clamp(min=0).long().reshape(-1)
        for layer in range(1, len(self.gpu)):
            if wait:
                self.prefetch.before_shared(layer)
            reads.append(self.gpu[layer].device_kv[rows])
        if not wait:  # still join the prefetch stream before the next step
            for layer in range(1, len(self.gpu)):
                self.prefetch.before_shared(layer)
        return reads

    def reference_step(self) -> None:
        for w in self.want[1:]:
            w.top_k_tokens.copy_(self.want[0].top_k_tokens)
        for w in self.want:
            ref.swap_in(*w.args())

    def compare(self, tag: str) -> None:
        torch.cuda.synchronize()
        want0 = self.want[0]
        for layer, (g, w) in enumerate(zip(self.gpu, self.want)):
            if layer == 0:
                for name in ("out", "slot_tokens", "lru"):
                    assert torch.equal(getattr(g, name).cpu(), getattr(w, name)), (tag, name)
            else:  # a shared layer reuses the anchor's output
                assert torch.equal(w.out, want0.out), (tag, layer)
            kv = g.device_kv.cpu()
            if not torch.equal(kv, w.device_kv):
                bad = (kv != w.device_kv).any(1).nonzero().squeeze(1)
                raise AssertionError(f"{tag}: layer {layer} device_kv differs in {bad.numel()} "
                                     f"rows, first {bad[:8].tolist()}")

    def expected_reads(self) -> list:
        """Each shared layer's bytes of the rows the anchor's output names (reference)."""
        rows = self.want[0].out.clamp(min=0).long().reshape(-1)
        return [w.device_kv[rows] for w in self.want[1:]]

    def refresh(self, seed: int, miss_rate: float) -> None:
        refresh_top_k(self.want[0], seed=seed, miss_rate=miss_rate)
        self.gpu[0].top_k_tokens.copy_(self.want[0].top_k_tokens)


# The default grid (16 x 512), one 512-thread block per SM (the default until
# 2026-12-05), the one-warp blocks over every SM, and a few large blocks.
GRIDS = [ReplayGrid(), ReplayGrid(None, 512), ReplayGrid(None, 32), ReplayGrid(8, 512)]


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("top_k,hot", [(64, 128), (2048, 4096)])
def test_replay_is_the_synchronous_swap_in_byte_for_byte(top_k, hot, grid):
    seed = _seed()
    gen = random.Random(seed)
    lens = [hot * 4, hot // 2, hot * 2 + 3, hot + 1, hot * 8, 5000]
    case = make_case(seq_lens=lens, top_k=top_k, hot=hot, page=PAGE, miss_rate=0.6,
                     item_bytes=1152, seed=seed, num_real=5, duplicates=2, pad_top_k=3)
    layers = Layers(case, shared=3, seed=seed + 1, grid=grid)
    for step in range(4):
        layers.gpu_step()
        layers.reference_step()
        layers.compare(f"seed={seed} step={step}")
        layers.refresh(seed + 11 * step, gen.random())
    assert layers.prefetch.replays == 4 * 3


@pytest.mark.parametrize("high_priority", [False, True], ids=["low", "high"])
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_plan_replay_under_cuda_graph_capture(grid, high_priority):
    """Captured on the capture stream with the prefetch stream forked from
    it; at a higher priority (SGLANG_HISPARSE_PREFETCH_PRIORITY=1) the
    replays keep it in the graph and still land before the reads."""
    seed = _seed()
    gen = random.Random(seed)
    bs, top_k = 8, 512
    case = graph_case(seed, top_k=top_k)

    # warm up (builds, smem opt-in, the copy's checks) on throwaway copies, on
    # the capture stream, as SGLang's graph runner does
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    scratch = Layers(case, shared=2, seed=seed + 1, grid=grid, high_priority=high_priority)
    with torch.cuda.stream(capture):
        scratch.gpu_step()
    torch.cuda.synchronize()

    layers = Layers(case, shared=2, seed=seed + 1, grid=grid, high_priority=high_priority)
    # the static outputs of what attention reads, per shared layer
    reads_out = [torch.empty((bs * top_k, case.device_kv.size(1)), dtype=torch.uint8,
                             device="cuda") for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        for dst, got in zip(reads_out, layers.gpu_step()):
            dst.copy_(got)
    assert not layers.prefetch.pending  # every replay joined inside the capture

    for step, real in enumerate([8, 3, 0, 5, 8, 1]):
        if step:
            layers.refresh(seed + 7 * step, gen.random())
        for w in layers.want:
            w.num_real_reqs.fill_(real)
        layers.gpu[0].num_real_reqs.fill_(real)
        graph.replay()
        layers.reference_step()
        layers.compare(f"seed={seed} graph step={step} real={real}")
        for layer, (got, want) in enumerate(zip(reads_out, layers.expected_reads()), 1):
            assert torch.equal(got.cpu(), want), f"seed={seed} step={step} layer {layer} reads"


def _race_case(seed):
    # every selected entry misses (a fresh buffer per request), 16 requests x 2048
    hot, top_k = 4096, 2048
    lens = [30000 + 997 * i for i in range(16)]
    case = make_case(seq_lens=lens, top_k=top_k, hot=hot, page=PAGE, miss_rate=1.0,
                     item_bytes=1152, seed=seed)
    case.slot_tokens[:, :hot] = -1  # nothing held: every entry but the newest misses
    return case


def _race_layers(seed, shared: int, delay_cycles: int, high_priority: bool = False) -> Layers:
    """The race case's layers with a slow link, after one step of the same
    shapes on throwaway layers. Loading a CUDA module (each kernel's first
    call, the spin included) synchronizes the device: a first call made
    behind a slow replay would wait for it and hide the race (on the H200 the
    control then saw none); the warm-up also leaves the step's allocations in
    torch's cache."""
    scratch = Layers(_race_case(seed), shared=shared, seed=seed + 1, high_priority=high_priority)
    scratch.prefetch.link_delay_cycles = 1000
    scratch.gpu_step()
    torch.cuda.synchronize()
    layers = Layers(_race_case(seed), shared=shared, seed=seed + 1, high_priority=high_priority)
    layers.prefetch.link_delay_cycles = delay_cycles
    return layers


@pytest.mark.parametrize("high_priority", [False, True], ids=["low", "high"])
def test_shared_layer_never_reads_before_its_copy_landed(high_priority):
    seed = _seed()
    layers = _race_layers(seed, 3, 20_000_000, high_priority)  # ~10 ms per replay: a slow link
    for step in range(3):
        reads = layers.gpu_step()
        layers.reference_step()
        for layer, (got, want) in enumerate(zip(reads, layers.expected_reads()), 1):
            bad = (got.cpu() != want).any(1).sum().item()
            assert bad == 0, f"seed={seed} step={step}: layer {layer} read {bad} rows early"
        layers.compare(f"seed={seed} step={step}")
        for twin in layers.want + layers.gpu[:1]:  # a fresh buffer again: all miss
            twin.slot_tokens[:, :4096] = -1
        layers.refresh(seed + 3 * step, 1.0)


def test_without_the_wait_the_read_is_stale():
    """The negative control of the race test: the same reads without the
    shared layers' waits see rows the slow replay has not written yet."""
    seed = _seed()
    layers = _race_layers(seed, 2, 200_000_000)  # ~100 ms before each replay
    reads = layers.gpu_step(wait=False)
    layers.reference_step()
    stale = sum(int((got.cpu() != want).any(1).sum())
                for got, want in zip(reads, layers.expected_reads()))
    assert stale > 0, f"seed={seed}: no read raced the replay (the race test could not fail)"
    layers.compare(f"seed={seed}")  # the replays themselves still landed
