"""IndexShare prefetch: an anchor layer plans, its shared layers' bytes follow on a side stream.

A shared layer (:mod:`.index_share`) selects exactly its anchor's positions,
and every hot-buffer table starts and is reset for all layers at once, so a
synchronous swap-in of the shared layer would make the anchor's decisions
again: the same hits, the same victims, the same output slots (the lockstep
``tests/test_index_share.py`` checks through the reference). So only the
anchor resolves. Its swap-in records the miss plan (host row -> device row
per miss, per request) into fixed buffers here; right after it, the
prefetch stream replays that plan on each of the anchor's shared layers'
pools (``kernels.copy_planned``, copy only) while the forward stream goes on
with the anchor's attention and the layers after it. A shared layer's
"swap-in" then waits for its own replay's event and returns the anchor's
output, which no swap-in overwrites before the next anchor.

While the prefetch runs, a shared layer's own ``slot_tokens``/``lru``
entries are never read or advanced: the anchor's entries are its table
(:meth:`IndexSharePrefetch.table_layer`). ``slot_locs`` (rows per slot) are
written for all layers alike and stay the same.

Order rules (CUDA; on the CPU everything runs in call order):

* the replays start after an event recorded on the forward stream right
  after the anchor's swap-in, so they read the plan it wrote, host rows the
  write-through completed (the forward waited for it) and write rows the
  previous step's attention is done with;
* each shared layer's attention waits for its own replay's event, so it
  never reads a row before the copy landed;
* the next anchor's swap-in rewrites the plan, so it first waits for any
  replay whose event no shared layer waited for (none in a well-formed
  model: every shared layer of an anchor runs before the next anchor).

All of it is CUDA-graph capturable: the plan buffers are allocated once for
the largest batch, the events are recorded and waited for inside the
captured forward (the prefetch stream forks from and joins the capture
stream), and the replay reads the real-row count on the device.

With ``SGLANG_HISPARSE_SKIP_IO=1`` the anchor moves no bytes and neither do
the replays (none are launched). Speculative verify rows work unchanged:
the plan is per request, ``draft_tokens x top_k`` wide. A shared layer
resolves nothing and adds nothing to the swap-in's tally; its anchor's
call counts for itself and each of its shared layers
(:attr:`IndexSharePrefetch.layers_per_swap_in`), so the hit and miss
counters read as a synchronous run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from sglang_hisparse.config import PREFETCH_GRID_ENV
from sglang_hisparse.engine.index_share import LayerRoles
from sglang_hisparse.engine.streams import Streams


@dataclass(frozen=True)
class ReplayGrid:
    """How each replay launches: ``blocks`` (None: one per SM) of ``threads``.

    A replay's blocks loop until every miss has moved, so each holds its SM
    for the whole replay, and the forward's GEMMs and attention (one block
    that takes a whole SM's registers) cannot start there meanwhile. With one
    512-thread block per SM the replay shuts the forward out of every SM: on
    the H200 (bench_kernels.py --overlap, 16 requests, 3 replays beside a
    V3.2 layer stand-in) it hid 2-3% of the shorter side, 8 blocks hid 32-58%
    at 47 GB/s, 4 blocks lost bandwidth (35-38 GB/s). Served (8 V3.2 layers,
    FSSSFSSS, calibrated top-k) 8 x 512 was still slower than synchronous
    swap-ins (step 3.78 vs 3.26 ms), so the default stayed one 512-thread
    block per SM, which served level with them (2026-12-02, random weights). 32-thread
    blocks (one warp, 1,024 registers) were meant to fit beside those
    kernels' blocks instead of displacing them; measured, they hide less
    than 8 blocks of 512: one per SM 23% (13% misses) and 21% (50%), two per
    SM 18% and 0%, against 37% and 60% for 8 x 512 in the same run
    (docs/gpu-runs/2026-12-03-s5/, 2026-12-04/). Where the step is bound by
    the GPU (20 V3.2 layers, FSSS x 5, calibrated top-k) the default grid
    closed 0.33-0.35 of the step gap between synchronous swap-ins and no
    host IO (2026-12-04-s4); 1024 blocks of 512, most of them exiting at
    once, hid nothing beside the stand-in.

    The default is 16 blocks of 512 with the prefetch stream above the
    forward's priority (engine/streams.py): the replay's few blocks are
    placed first and the forward's fill the other SMs. Served side by side
    on the H200 (same 20-layer model and workload, two runs, each config one
    launch) it closed 0.65 and 0.63 of the step gap, where one block per SM
    at the forward's priority closed 0.32 in the second run; decode-only
    0.88 of skip-IO in both (docs/gpu-runs/2026-12-05-s2/)."""

    blocks: Optional[int] = 16
    threads: int = 512

    @classmethod
    def parse(cls, value: str, name: str = PREFETCH_GRID_ENV) -> "ReplayGrid":
        """``BLOCKSxTHREADS``: BLOCKS an integer from 1 to 1024 or ``sm``
        (one per SM), THREADS 512 or 32; else a ValueError naming ``name``."""
        blocks_text, sep, threads_text = value.strip().lower().partition("x")
        grid = None
        if sep and threads_text in ("512", "32"):
            if blocks_text == "sm":
                grid = cls(None, int(threads_text))
            elif blocks_text.isdigit() and 1 <= int(blocks_text) <= 1024:
                grid = cls(int(blocks_text), int(threads_text))
        if grid is None:
            raise ValueError(
                f"{name}={value!r} is not valid; allowed: BLOCKSxTHREADS, BLOCKS an integer "
                f"from 1 to 1024 or sm (one per SM), THREADS 512 or 32 (e.g. 16x512, the "
                f"default, or smx512)")
        return grid

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "ReplayGrid":
        value = environ.get(PREFETCH_GRID_ENV)
        return cls.parse(value) if value is not None else cls()

    def __str__(self) -> str:
        """The spelling :meth:`parse` reads."""
        return f"{self.blocks or 'sm'}x{self.threads}"


class IndexSharePrefetch:
    def __init__(self, roles: LayerRoles, *, max_requests: int, plan_width: int, device,
                 streams: Streams, skip_io: bool = False, grid: ReplayGrid = ReplayGrid()):
        self.roles = roles
        self.grid = grid
        self.streams = streams
        self.skip_io = skip_io
        self.is_shared = roles.is_shared
        self.anchor_of = roles.anchor_of
        self.followers = roles.followers
        # How many layers' swap-in each layer's call stands for in the miss
        # counters: an anchor's plan is moved once more per shared layer.
        self.layers_per_swap_in = tuple(1 + len(self.followers.get(layer, ()))
                                        for layer in range(roles.num_layers))
        # The plan of the last anchor's swap-in (rows past its batch unused).
        self.miss_src = torch.zeros((max_requests, plan_width), dtype=torch.int64, device=device)
        self.miss_dst = torch.zeros((max_requests, plan_width), dtype=torch.int32, device=device)
        self.miss_count = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.anchor_done = streams.event()
        self.landed = {layer: streams.event() for f in self.followers.values() for layer in f}
        # Shared layers whose replay is launched and not yet waited for.
        self.pending: set[int] = set()
        # Tests and the race check only: GPU cycles the prefetch stream spins
        # before each replay (a slow host link).
        self.link_delay_cycles = 0
        self.replays = 0  # replays launched (a count for tests and logs)

    def table_layer(self, layer_id: int) -> int:
        """The layer whose slot tables a layer's swap-in uses."""
        return self.anchor_of[layer_id]

    def records_plan(self, layer_id: int) -> bool:
        return layer_id in self.followers

    def plan(self, requests: int) -> dict:
        """The plan buffers for an anchor swap-in of ``requests`` requests."""
        return dict(miss_src=self.miss_src[:requests], miss_dst=self.miss_dst[:requests],
                    miss_count=self.miss_count[:requests])

    def before_anchor(self) -> None:
        """The anchor's swap-in is about to overwrite the plan."""
        if self.pending:
            for layer in self.pending:
                self.landed[layer].wait(_current_stream(self.streams))
            self.pending.clear()

    def replay_followers(self, anchor: int, requests: int, num_real_reqs: torch.Tensor,
                         pools: Callable[[int], tuple], layout: str, copy: Callable) -> None:
        """Launch the copy-only replay of the anchor's plan for each of its
        shared layers; ``pools(layer)`` gives (host_kv, device_kv) as uint8
        rows, ``copy`` is ``kernels.copy_planned.copy_planned_selected``."""
        followers = self.followers[anchor]
        if self.skip_io or requests == 0:
            return
        plan = self.plan(requests)
        streams = self.streams

        def replay(layer: int) -> None:
            host_kv, device_kv = pools(layer)
            copy(**plan, num_real_reqs=num_real_reqs, host_kv=host_kv, device_kv=device_kv,
                 layout=layout, num_blocks=self.grid.blocks, threads=self.grid.threads)

        if not streams.gpu:
            for layer in followers:
                replay(layer)
            self.replays += len(followers)
            return
        self.anchor_done.record()
        with torch.cuda.stream(streams.prefetch):
            streams.prefetch.wait_event(self.anchor_done)
            for layer in followers:
                if self.link_delay_cycles:
                    torch.cuda._sleep(self.link_delay_cycles)
                replay(layer)
                self.landed[layer].record(streams.prefetch)
        self.pending.update(followers)
        self.replays += len(followers)

    def before_shared(self, layer_id: int) -> None:
        """A shared layer is about to read its rows: wait for its replay."""
        if layer_id in self.pending:
            self.landed[layer_id].wait(_current_stream(self.streams))
            self.pending.discard(layer_id)


def _current_stream(streams: Streams):
    return torch.cuda.current_stream() if streams.gpu else None
