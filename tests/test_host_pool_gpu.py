"""The DeepSeek-V4 C4 host pool's GPU copies, byte for byte against its CPU path.

On a GPU, ``HiSparseC4HostPool`` moves tokens with SGLang's
``transfer_cache_dsv4_mla`` kernel through per-layer pointer arrays; the CPU
tests (test_host_pool.py) check only the CPU path and a stand-in for the
kernel. Here the kernel itself runs: write-through from device pages to
pinned host pages for every layer, and a swap-in of one layer back, both
compared with the CPU path's copy of the same tokens (the value run and the
scale run of each token, page-padded, at whatever page offset it sits).
"""

import pytest
import torch

from sglang_hisparse.kernels import reference
from sglang_hisparse.pools.host import HiSparseC4HostPool, c4_page_bytes

pytestmark = pytest.mark.gpu

LAYERS, DEVICE_PAGES, HOST_PAGES = 3, 6, 8


def _device_pages(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (DEVICE_PAGES, c4_page_bytes()), dtype=torch.uint8, generator=g)
            for _ in range(LAYERS)]


def _rows(buf, slots):
    return reference.read_rows(buf.cpu(), slots.cpu(), layout="c4")


@pytest.fixture
def pools():
    """The same random device pages on the GPU and on the CPU, and a host pool for each."""
    cpu_pages = _device_pages(7)
    gpu_pages = [p.cuda() for p in cpu_pages]
    gpu = HiSparseC4HostPool(gpu_pages, num_host_pages=HOST_PAGES)
    cpu = HiSparseC4HostPool(cpu_pages, num_host_pages=HOST_PAGES)
    # Unpinned host memory comes uninitialised: start both alike, so that a
    # whole-buffer comparison also catches bytes the kernel writes outside
    # the tokens (the page padding, a neighbour's run).
    for b in gpu.kv_buffer + cpu.kv_buffer:
        b.zero_()
    assert gpu.pin_memory and all(b.is_pinned() for b in gpu.kv_buffer)
    return gpu, cpu


# Tokens that cross pages and sit at a page's first and last offsets.
DEVICE_SLOTS = torch.tensor([0, 63, 64, 65, 130, 255, 320, 383])
HOST_SLOTS = torch.tensor([511, 0, 70, 71, 200, 64, 129, 300])


def test_write_through_every_layer_matches_the_cpu_copy(pools):
    gpu, cpu = pools
    gpu.backup_from_device_all_layer(None, HOST_SLOTS.cuda(), DEVICE_SLOTS.cuda())
    torch.cuda.synchronize()
    cpu.backup_from_device_all_layer(None, HOST_SLOTS, DEVICE_SLOTS)
    for layer in range(LAYERS):
        assert torch.equal(gpu.kv_buffer[layer], cpu.kv_buffer[layer]), f"layer {layer}"
        assert torch.equal(_rows(gpu.kv_buffer[layer], HOST_SLOTS),
                           _rows(gpu.device_buffers[layer], DEVICE_SLOTS))
    # The control: the host pages start zeroed, so the copy must have moved bytes.
    assert int(gpu.kv_buffer[0].count_nonzero()) > 0


def test_swap_in_one_layer_matches_the_cpu_copy_and_leaves_the_others(pools):
    gpu, cpu = pools
    gpu.backup_from_device_all_layer(None, HOST_SLOTS.cuda(), DEVICE_SLOTS.cuda())
    cpu.backup_from_device_all_layer(None, HOST_SLOTS, DEVICE_SLOTS)
    back = torch.tensor([1, 2, 128, 191, 192, 256, 257, 319])  # other device tokens
    before = [b.clone() for b in gpu.device_buffers]
    gpu.load_to_device_per_layer(None, HOST_SLOTS.cuda(), back.cuda(), 1)
    torch.cuda.synchronize()
    cpu.load_to_device_per_layer(None, HOST_SLOTS, back, 1)
    assert torch.equal(gpu.device_buffers[1].cpu(), cpu.device_buffers[1])
    assert torch.equal(_rows(gpu.device_buffers[1], back), _rows(gpu.device_buffers[1], DEVICE_SLOTS))
    assert not torch.equal(gpu.device_buffers[1], before[1])
    for layer in (0, 2):
        assert torch.equal(gpu.device_buffers[layer], before[layer]), f"layer {layer} was written"
