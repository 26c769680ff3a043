"""Each host pinning mode gives pinned memory the GPU can copy from and to."""

import pytest
import torch

from sglang_hisparse.pools import host_memory

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", host_memory.MODES)
def test_mode_is_pinned_and_round_trips(mode):
    t = host_memory.alloc_pinned((1024, 1152), torch.uint8, mode=mode)
    assert t.is_pinned()
    src = torch.randint(0, 256, (1024, 1152), dtype=torch.uint8, device="cuda")
    t.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    host_memory.release(t)
