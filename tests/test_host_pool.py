"""Host pools on CPU: page-granular allocation, row layouts, copies, teardown."""

import pytest
import torch

from dataplane_fixtures import PS, dsa_pool, req_pool
from sglang_hisparse.host_pool import (
    C4_SCALE_BYTES, C4_VALUE_BYTES, HiSparseC4HostPool, HiSparseMLAHostPool, HostPoolExhausted,
    c4_page_bytes,
)


@pytest.fixture
def pool():
    return dsa_pool(512)


def test_mla_row_bytes_bf16_and_fp8(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    assert host.item_bytes == 1152 and host.layer_rows(0).shape == (host.size, 1152)
    assert host.size % PS == 0 and host.size > 2 * 512
    assert not host.pin_memory  # CPU device pool: nothing to pin
    fp8 = dsa_pool(512, dtype=torch.float8_e4m3fn, kv_cache_dim=656)
    h8 = HiSparseMLAHostPool(fp8, host_to_device_ratio=2, page_size=PS)
    assert h8.item_bytes == 656


def test_built_on_hicache_mla_host_pool(pool):
    from sglang.srt.mem_cache.memory_pool_host import HostKVCache, MLATokenToKVPoolHost

    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    assert isinstance(host, MLATokenToKVPoolHost) and isinstance(host, HostKVCache)


def test_paged_token_slots_grow_by_page_and_release(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    r2t = req_pool()
    table = torch.full((8, 1024 + PS), -1, dtype=torch.int64)
    lens = torch.zeros(8, dtype=torch.int64)
    total = host.available_size()
    rows = host.try_alloc_paged_token_slots(table, lens, 3, 0, 100)
    assert rows.numel() == 100 and int(lens[3]) == 128
    assert host.available_size() == total - 128
    assert rows[:64].tolist() == list(range(int(rows[0]), int(rows[0]) + 64))
    one = host.try_alloc_paged_token_slots(table, lens, 3, 100, 1)  # inside the page
    assert host.available_size() == total - 128 and int(one[0]) == int(table[3, 100])
    host.try_alloc_paged_token_slots(table, lens, 3, 128, 1)  # next page
    assert host.available_size() == total - 192
    assert host.allocated_host_indices(table, 3, lens[3]).numel() == 192
    assert host.release_request_rows(table, lens, 3) == 3
    assert host.available_size() == total and int(lens[3]) == 0 and bool((table[3] == -1).all())


def test_exhausted_pool_returns_none_then_raises_on_strict_api(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    table = torch.full((2, 4096), -1, dtype=torch.int64)
    lens = torch.zeros(2, dtype=torch.int64)
    grab = host.alloc_page(host.free_page_count() - 1)
    assert host.try_alloc_paged_token_slots(table, lens, 0, 0, 2 * PS) is None
    assert int(lens[0]) == 0 and bool((table[0] == -1).all())  # nothing half-done
    with pytest.raises(HostPoolExhausted):
        host.alloc_paged_token_slots(table, lens, 0, 0, 2 * PS)
    host.free(grab)
    assert host.try_alloc_paged_token_slots(table, lens, 0, 0, 2 * PS) is not None


def test_double_free_detected(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    rows = host.alloc_page(1)
    host.free(rows)
    with pytest.raises(RuntimeError, match="double free"):
        host.free(rows)


def test_cpu_backup_and_load_roundtrip(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    dev_rows = torch.tensor([70, 71, 200], dtype=torch.int64)
    host_rows = torch.tensor([5, 900, 64], dtype=torch.int64)
    for layer in range(pool.layer_num):
        pool.kv_buffer[layer][dev_rows] = torch.randn(3, 1, 576).to(torch.bfloat16)
    host.backup_from_device_all_layer(pool, host_rows, dev_rows, io_backend="kernel")
    for layer in range(pool.layer_num):
        assert torch.equal(host.kv_buffer[layer][host_rows], pool.kv_buffer[layer][dev_rows])
    back = torch.tensor([300, 301, 302], dtype=torch.int64)
    host.load_to_device_per_layer(pool, host_rows, back, 1, io_backend="kernel")
    assert torch.equal(pool.kv_buffer[1][back], pool.kv_buffer[1][dev_rows])


def test_destroy_is_idempotent(pool):
    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    host.destroy()
    host.destroy()


def test_c4_layout_and_token_copies():
    pages = 4
    page_bytes = c4_page_bytes()
    assert page_bytes % C4_VALUE_BYTES == 0 and page_bytes >= PS * (C4_VALUE_BYTES + C4_SCALE_BYTES)
    dev = [torch.randint(0, 255, (pages, page_bytes), dtype=torch.uint8) for _ in range(2)]
    host = HiSparseC4HostPool(dev, num_host_pages=8)
    assert host.size == 8 * PS and host.kv_buffer[0].shape == (8, page_bytes)
    src = torch.tensor([3, 64 + 17], dtype=torch.int64)
    dst = torch.tensor([130, 5], dtype=torch.int64)
    host.backup_from_device_all_layer(None, dst, src)
    for layer in range(2):
        for s, d in zip(src.tolist(), dst.tolist()):
            sp, so = divmod(s, PS)
            dp, do = divmod(d, PS)
            v = slice(so * C4_VALUE_BYTES, (so + 1) * C4_VALUE_BYTES)
            vd = slice(do * C4_VALUE_BYTES, (do + 1) * C4_VALUE_BYTES)
            assert torch.equal(host.kv_buffer[layer][dp, vd], dev[layer][sp, v])
            sc = PS * C4_VALUE_BYTES
            assert torch.equal(
                host.kv_buffer[layer][dp, sc + do * 8 : sc + do * 8 + 8],
                dev[layer][sp, sc + so * 8 : sc + so * 8 + 8],
            )
    # load back into other device slots of one layer
    host.load_to_device_per_layer(None, dst, torch.tensor([200, 201]), 0)
    rows = host.alloc_page(2)
    assert rows.numel() == 2 * PS
    host.free(rows)
    assert host.available_size() == 8 * PS
    host.destroy()


def test_c4_matches_kernel_reference_layout():
    from sglang_hisparse.kernels import reference

    assert c4_page_bytes() == reference.C4_PAGE_BYTES
    dev = [torch.randint(0, 255, (2, c4_page_bytes()), dtype=torch.uint8)]
    host = HiSparseC4HostPool(dev, num_host_pages=2)
    host.backup_from_device_all_layer(None, torch.tensor([70]), torch.tensor([9]))
    got = reference.read_rows(host.kv_buffer[0], torch.tensor([70]), layout="c4")
    want = reference.read_rows(dev[0], torch.tensor([9]), layout="c4")
    assert torch.equal(got, want)
