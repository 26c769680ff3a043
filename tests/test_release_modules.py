"""adapter/releases/: one module per release line, picked for the installed
release in one place, each offering the same names."""

import pytest

from dataplane_fixtures import make_req
from sglang_hisparse import SUPPORTED_SGLANG_VERSIONS
from sglang_hisparse.adapter import releases
from sglang_hisparse.pinned_source import sglang_version

NAMES = ("prefill_len", "set_prefill_range", "sparse_config", "native_max_token_pool_size",
         "dsa_backend_defaults", "speculative_v2_worker", "speculative_seams_wired",
         "dsv4_kv_mode", "decode_host_transfer_backends", "index_share_rules",
         "kv_allocated_len", "set_kv_allocated_len", "call_running_batch", "prefill_batch",
         "no_prefill", "init_pools_sized", "mla_kv_cache_dim", "mla_host_pool_class",
         "override_server_args", "dsa_cell_accounting")


def test_every_pin_has_a_module_and_each_offers_the_same_names():
    versions = SUPPORTED_SGLANG_VERSIONS
    chosen = {v: releases.module_for(v).__name__.rsplit(".", 1)[1] for v in versions}
    assert chosen == {"0.5.13": "sglang_0_5_13", "0.5.13.post1": "sglang_0_5_13",
                      "0.5.15.post1": "sglang_0_5_15", "0.5.17": "sglang_0_5_17"}
    for name in set(chosen.values()):
        module = releases.module_for(next(v for v, n in chosen.items() if n == name))
        missing = [n for n in NAMES if not callable(getattr(module, n, None))]
        assert not missing, (name, missing)
    with pytest.raises(ValueError, match="predates"):
        releases.module_for("0.5.11")


def test_the_installed_release_picks_its_module():
    assert releases.current is releases.module_for(sglang_version())
    assert releases.dsa_backend_defaults is releases.current.dsa_backend_defaults


def test_a_prefill_range_reads_back_on_the_installed_release():
    # A real Req of the installed release: what the prefill scheduler records
    # is what the coordinator reads.
    req = make_req("r", 300)
    releases.current.set_prefill_range(req, 64, 300)
    assert releases.current.prefill_len(req) == 300
    releases.current.set_prefill_range(req, 0, 128)
    assert releases.current.prefill_len(req) == 128


def test_the_allocated_length_reads_back_on_the_installed_release():
    # A real Req: nothing allocated reads 0 (0.5.17: no req.kv yet), what the
    # allocation paths record is what the coordinator reads.
    req = make_req("r", 300)
    assert releases.current.kv_allocated_len(req) == 0
    releases.current.set_kv_allocated_len(req, 300)
    releases.current.set_kv_allocated_len(req, releases.current.kv_allocated_len(req) + 1)
    assert releases.current.kv_allocated_len(req) == 301


def test_sparse_config_carries_the_block_size():
    from sglang_hisparse.config import parse_hisparse_config

    config = parse_hisparse_config('{"swap_in_block_size": 128}').resolve(2048)
    sparse = releases.current.sparse_config(config)
    assert (sparse.top_k, sparse.device_buffer_size, sparse.host_to_device_ratio) == (2048, 4096, 2)
    assert sparse.sparse_extra_config == {"swap_in_block_size": 128}
    # Where the release's SparseConfig has the field (0.5.15), it is set too.
    assert getattr(sparse, "swap_in_block_size", 128) == 128
