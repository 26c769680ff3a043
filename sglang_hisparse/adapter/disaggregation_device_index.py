"""PD with a HiSparse DeepSeek-V4 decode: the device tail's own page indices.

A HiSparse PD decode receives the prefill's KV into two kinds of memory
(0.5.13 ``DecodePreallocQueue._init_kv_manager``, decode.py:392-409): the
C4 KV of every C4 layer lands in our host pool (``HiSparseC4HostPool``,
addressed by *host* page), and the buffers that stay on the GPU are
registered after them, the *device tail*: the C4 indexer's keys (one
buffer per C4 layer, ``c4_logical_size`` compressed ids) and the C128 KV
(one per C128 layer). Both are addressed by *logical* page: a full id
``f`` has its indexer key at compressed id ``f // 4`` (page ``f // 256``
of 64 rows) and its C128 entry at ``f // 128`` (page ``f // 256`` of 2
rows), exactly as on a prefill without HiSparse, whose page indices are
its ``req_to_token`` pages. The SWA window and the compressor states are
not in the tail: they travel as the SWA state component, whose indices the
decode already computes through the full-to-SWA mapping.

0.5.13 sends one index vector, the host pages, and the prefill uses it for
every registered buffer: the device tail is written at host page numbers,
which are other requests' logical pages (their indexer keys and C128 KV
overwritten, this request's left stale). 0.5.17 carries a second vector
(``TransferInfo.dst_device_kv_indices``, mooncake/conn.py:88, used for the
pointers after the C4 layers, 779-803). Here, up to 0.5.15.post1:

* decode (source patch of ``DecodePreallocQueue.pop_preallocated``): the
  request's logical pages, from ``req_to_token`` through SGLang's own
  ``kv_to_page_indices``, are packed with the host pages into the one
  int32 vector the metadata message carries (:func:`pack_device_tail_pages`);
* prefill (source patch of ``MooncakeKVManager.transfer_worker``): the
  vector is unpacked once per destination (:func:`unpack_transfer_info`),
  each chunk takes its slice of both, and ``send_kvcache`` (AROUND,
  :func:`send_kvcache_with_device_tail`) sends the host-backed entries with
  the host pages and the tail with the logical pages, through SGLang's own
  ``_send_kvcache_generic``.

The wire format (int32, ``n`` pages)::

    [host pages + HOST_PAGE_OFFSET] * n, [device pages] * n, host_entries, n, TAG

``host_entries`` is how many of the decode's registered KV entries are
host-backed (its C4 layer count). The offset is what makes a prefill that
does not know the format fail instead of writing garbage: it reads the
whole vector as destination pages, and each chunk takes its first ``n``
entries, which now lie ``2**30`` pages past every registered buffer. The
transfer engine refuses such an address (0.5.13's Mooncake: the batch
returns -1, ``tests/test_pd_transfer.py`` shows it), so the prefill fails
the request ("Failed to send kv chunk") before any byte moves, and the
decode aborts it. A prefill that runs this plugin reads the format; a
decode without HiSparse, or with a DSA model, sends plain pages, which
``unpack`` leaves alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)

# Added to every host page of a packed vector: a prefill that reads it as
# plain pages addresses far past any registered buffer (2**30 pages of at
# least a KiB each).
HOST_PAGE_OFFSET = 1 << 30
# The vector's last element: "HSD1", HiSparse device-index format 1.
TAG = 0x48534431
_TRAILER = 3  # host_entries, n, TAG


def pack_device_tail_pages(host_pages, device_pages, host_entries: int) -> np.ndarray:
    """The decode's metadata vector: host pages (offset), then the device
    tail's logical pages, then the trailer.

    ``device_pages`` may be one page longer than ``host_pages``: a prompt
    whose last full page holds fewer than 4 tokens closes no C4 group there,
    so it has no host page, no indexer key and no C128 entry on that page;
    the extra page is dropped. Fewer device pages than host pages cannot
    happen (every host page is some full page's C4 groups) and is refused.
    """
    host = np.asarray(host_pages, dtype=np.int64)
    device = np.asarray(device_pages, dtype=np.int64)
    n = host.size
    if device.size < n or device.size > n + 1:
        raise ValueError(
            f"device tail pages ({device.size}) do not match the host pages ({n})")
    if n and (host.min() < 0 or host.max() >= HOST_PAGE_OFFSET):
        raise ValueError(f"host pages outside [0, {HOST_PAGE_OFFSET})")
    packed = np.concatenate(
        [host + HOST_PAGE_OFFSET, device[:n], np.array([host_entries, n, TAG], dtype=np.int64)])
    return packed.astype(np.int32)


@dataclass(frozen=True)
class DestinationPages:
    """One decode destination's pages, as the prefill uses them."""

    host: np.ndarray  # the pages of every host-backed entry (all entries when plain)
    device: Optional[np.ndarray] = None  # the device tail's logical pages (None: plain)
    host_entries: int = 0  # how many registered entries are host-backed

    def send_kwargs(self, index_slice) -> dict:
        """``send_kvcache``'s extra arguments for one chunk (none when plain)."""
        if self.device is None:
            return {}
        return {"dst_device_kv_indices": self.device[index_slice],
                "dst_host_entries": self.host_entries}


def unpack_pages(indices: np.ndarray) -> DestinationPages:
    """The host and device pages of a metadata vector; a plain one (no
    trailer) is all host pages. A vector with the tag but an inconsistent
    layout raises: it was not written by :func:`pack_device_tail_pages`."""
    if indices.size < _TRAILER or int(indices[-1]) != TAG:
        return DestinationPages(host=indices)
    host_entries, n = int(indices[-3]), int(indices[-2])
    if n < 0 or indices.size != 2 * n + _TRAILER or host_entries < 0:
        raise ValueError(
            f"malformed HiSparse device-index vector: {indices.size} entries for {n} pages")
    host = indices[:n].astype(np.int64) - HOST_PAGE_OFFSET
    if n and host.min() < 0:
        raise ValueError("malformed HiSparse device-index vector: host pages not offset")
    return DestinationPages(host=host.astype(np.int32), device=indices[n:2 * n].copy(),
                            host_entries=host_entries)


def unpack_transfer_info(info) -> DestinationPages:
    """The pages of one Mooncake ``TransferInfo`` (its ``dst_kv_indices`` as
    the decode sent them), unpacked once and kept on it. Its
    ``dst_kv_indices`` stay as received, so two transfer workers reading the
    same info never see it half rewritten."""
    pages = getattr(info, "hisparse_destination_pages", None)
    if pages is None:
        raw = np.asarray(info.dst_kv_indices)
        try:
            pages = unpack_pages(raw)
        except ValueError as exc:
            # Used as it came, as a prefill without the plugin would: its
            # host part is offset past every buffer, so the engine refuses
            # the send and the request fails (the transfer thread lives on).
            logger.error("room %s: %s; the transfer will fail", info.room, exc)
            pages = DestinationPages(host=raw)
        info.hisparse_destination_pages = pages
    return pages


def prefill_host_entries(kv_args) -> Optional[int]:
    """How many of this prefill's KV entries are C4 layers (None: not a
    DeepSeek-V4 prefill): its pool lists the C4 layers first
    (``DeepSeekV4TokenToKVPool.get_contiguous_buf_infos``), for its PP stage."""
    ratios = getattr(kv_args, "mla_compression_ratios", None)
    if not ratios:
        return None
    start = getattr(kv_args, "prefill_start_layer", 0) or 0
    end = getattr(kv_args, "prefill_end_layer", None)
    return sum(1 for r in list(ratios)[start:end] if r == 4)


def send_kvcache_with_device_tail(original, self, mooncake_session_id, prefill_kv_indices,
                                  dst_kv_ptrs, dst_kv_indices, executor,
                                  dst_device_kv_indices=None, dst_host_entries=None):
    """AROUND ``MooncakeKVManager.send_kvcache`` (0.5.13 mooncake/conn.py:673).

    Without device pages: the release's own send. With them: the
    host-backed entries (the first ``dst_host_entries``) get the host
    pages, the rest (the device tail) the logical pages, each through
    SGLang's ``_send_kvcache_generic``. Both sides must list the same
    entries in the same order (one PP layout, the same model); otherwise
    the send fails (-1, the request fails) with a log line saying why."""
    if dst_device_kv_indices is None:
        return original(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                        dst_kv_indices, executor)
    src_ptrs, item_lens = self.kv_args.kv_data_ptrs, self.kv_args.kv_item_lens
    own_host_entries = prefill_host_entries(self.kv_args)
    problem = None
    if len(dst_kv_ptrs) != len(src_ptrs):
        problem = (f"the decode registered {len(dst_kv_ptrs)} KV entries, this prefill "
                   f"{len(src_ptrs)} (device-tail indices need one layout on both sides: "
                   "the same model and PP size)")
    elif own_host_entries is None or own_host_entries != dst_host_entries:
        problem = (f"the decode's first {dst_host_entries} KV entries are its host-backed C4 "
                   f"layers, this prefill has {own_host_entries} C4 layers")
    if problem:
        logger.error("HiSparse DeepSeek-V4 PD transfer refused: %s", problem)
        return -1
    h = dst_host_entries
    n = len(prefill_kv_indices)
    ret = self._send_kvcache_generic(
        mooncake_session_id=mooncake_session_id, src_data_ptrs=src_ptrs[:h],
        dst_data_ptrs=dst_kv_ptrs[:h], item_lens=item_lens[:h],
        prefill_data_indices=prefill_kv_indices, dst_data_indices=dst_kv_indices,
        executor=executor)
    if ret != 0:
        return ret
    return self._send_kvcache_generic(
        mooncake_session_id=mooncake_session_id, src_data_ptrs=src_ptrs[h:],
        dst_data_ptrs=dst_kv_ptrs[h:], item_lens=item_lens[h:],
        prefill_data_indices=prefill_kv_indices,
        dst_data_indices=np.asarray(dst_device_kv_indices[:n], dtype=np.int32),
        executor=executor)
