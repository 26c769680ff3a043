"""The in-server exactness check (``SGLANG_HISPARSE_CHECK=1``).

Comparing two servers' outputs proves little on a deep random-weight model
(two launches of the *baseline* already diverge at the first tokens), so
this checks the data plane where it can go wrong: after every layer's
swap-in, for every real request and valid top-k entry, the KV row attention
is about to read at the returned slot must equal the authoritative KV of
the selected position - the host row for a hot-buffer request, the
request's own mapped row for a resident or for the newest token (which
reaches host with the next step's write-through). The rules are those of
:mod:`sglang_hisparse.kernels.exactness`.

The check kernel runs on the forward stream right after the swap-in and
only accumulates into persistent device counters (entries checked,
mismatches, and the first mismatch: request slot, layer, batch row,
position, slot, host row, kind), so it is captured into SGLang's CUDA graphs
like the swap-in itself. The counters are read without a sync, as the
swap-in's tally is (they trail by one decode log line); the first mismatch
is fetched and logged once, at ERROR, the first time the count is non-zero.
Counting starts with the first decode step the scheduler prepares, after
CUDA-graph capture (see :meth:`ExactnessCheck.arm`).
"""

from __future__ import annotations

import logging

from sglang_hisparse.engine.streams import TrailingReader

logger = logging.getLogger(__name__)


class ExactnessCheck:
    def __init__(self, coord):
        from sglang_hisparse.kernels import exactness

        self._kernels = exactness
        self.coord = coord
        self.counters, self.first = exactness.new_check_state(coord.device)
        self._reader = TrailingReader(self.counters)
        self.first_mismatch = None  # dict once reported
        # SGLang's CUDA-graph capture runs the forward (eagerly, to warm up)
        # on dummy rows it declares real (num_real_reqs = the capture size,
        # request slot 0, seq_len 1): they are no request's KV, and the H200
        # runs showed exactly those rows as the only "mismatches" (sum of the
        # capture sizes x 2 warm-ups x layers). Counting starts at the first
        # decode step the scheduler prepares (:meth:`arm`).
        self.armed = False
        logger.warning("HiSparse exactness check on (SGLANG_HISPARSE_CHECK=1): every "
                       "decode step compares the KV rows each swap-in returns with the "
                       "authoritative KV; for debugging, it costs time")

    def arm(self) -> None:
        """Zero the counters: from now on every checked row is a request's."""
        self._reader.reset()
        self.first.zero_()
        self.first_mismatch = None
        self.armed = True

    def after_swap_in(self, top_k_tokens, out, req_pool_indices, seq_lens, layer_id,
                      host_kv, device_kv, layout, draft_tokens: int = 1) -> None:
        coord = self.coord
        extra = {}
        if layout == "rows":
            extra = dict(resident=coord.req_resident,
                         req_to_token=coord.req_to_token_pool.req_to_token,
                         token_to_row=coord._mapping())
        self._kernels.check_swap_in(
            top_k_tokens=top_k_tokens, out=out, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, num_real_reqs=coord.num_real_reqs.tensor,
            slot_locs=coord.req_device_buffer_token_locs[layer_id],
            host_locs=coord.req_to_host_pool, host_kv=host_kv, device_kv=device_kv,
            hot_buffer_size=coord.device_buffer_size, layer_id=layer_id,
            counters=self.counters, first=self.first, layout=layout,
            draft_tokens=draft_tokens,
            **extra)

    def read(self) -> dict:
        """``exact_checked`` / ``exact_mismatches`` (trailing by one reading
        on a GPU); logs the first mismatch once."""
        checked, mismatches = self._reader.read()
        if mismatches and self.first_mismatch is None:
            self.first_mismatch = self._kernels.decode_first_mismatch(self.first.tolist())
            logger.error("HiSparse exactness check: first mismatch %s (%d of %d entries "
                         "checked so far differ)", self.first_mismatch, mismatches, checked)
        return {"exact_checked": checked, "exact_mismatches": mismatches}
