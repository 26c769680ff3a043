"""Index tensors built per step reach the GPU without a stream sync.

A decode or verify step's Python runs while the previous step's forward is
still on the GPU (the overlap scheduler); a synchronizing call there makes
the CPU wait for it. torch's sync debug mode "error" raises on such a call,
so it tells a sync-free copy from a blocking one.
"""

import pytest
import torch

from sglang_hisparse.engine.streams import device_index, fill_at

pytestmark = pytest.mark.gpu


@pytest.fixture
def syncs_raise():
    """A synchronizing call raises, and the stream is kept busy, so that a
    blocking copy would have to wait."""
    torch.cuda.init()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        busy = busy @ busy / 64
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_device_index_does_not_sync_where_a_plain_copy_does(syncs_raise):
    got = device_index([3, 1, 2], "cuda")
    with pytest.raises(RuntimeError, match="synchroniz"):
        torch.tensor([3, 1, 2], dtype=torch.int64, device="cuda")  # the control
    torch.cuda.set_sync_debug_mode("default")
    assert got.dtype == torch.int64 and got.tolist() == [3, 1, 2]


def test_device_index_values_survive_the_staging_buffers_reuse():
    # The pinned staging memory goes back to PyTorch's cache once its copy
    # has run; later indices must not see another call's values.
    outs = [device_index(list(range(k, k + 64)), "cuda") for k in range(200)]
    torch.cuda.synchronize()
    assert all(o.tolist() == list(range(k, k + 64)) for k, o in enumerate(outs))


def test_a_cpu_tensor_reaches_the_gpu_the_same_way(syncs_raise):
    # The host pool hands its new pages' rows over as a CPU tensor (int64
    # from the page ids, or any int dtype): staged through pinned memory too.
    rows = torch.arange(128, 192, dtype=torch.int32)
    got = device_index(rows, "cuda")
    torch.cuda.set_sync_debug_mode("default")
    assert got.dtype == torch.int64 and got.tolist() == list(range(128, 192))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_fill_at_does_not_sync_where_an_index_assignment_does(syncs_raise, dtype):
    # The verify commit unmaps its slots after every MTP step this way
    # (2026-12-04-s2: the index assignment was ours' one sync per step).
    mapping = torch.arange(1, 1025, dtype=torch.int64, device="cuda")
    where = device_index([3, 700, 1023], "cuda")  # made without a sync, as the step makes it
    index = where.to(dtype) if dtype != torch.bool else torch.zeros(
        1024, dtype=torch.bool, device="cuda").index_fill_(0, where, True)
    fill_at(mapping, index, 0)
    with pytest.raises(RuntimeError, match="synchroniz"):
        mapping[where] = 0  # the control
    torch.cuda.set_sync_debug_mode("default")
    want = torch.arange(1, 1025)
    want[[3, 700, 1023]] = 0
    assert torch.equal(mapping.cpu(), want)


def test_fill_at_one_position_does_not_sync_where_an_int_assignment_does(syncs_raise):
    # Residency sets and clears a request's kernel flag this way: t[i] = 1
    # copies a 0-d CPU tensor onto a 0-d slot (a sync; seen 2026-12-04-s2).
    resident = torch.zeros(8, dtype=torch.int32, device="cuda")
    fill_at(resident, 5, 1)
    control = torch.zeros(8, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"):
        control[2] = 1  # raises at its sync, before the copy (2026-12-04-s3)
    torch.cuda.set_sync_debug_mode("default")
    assert resident.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
