"""The pure ``--hisparse-config`` parser (no SGLang import)."""

import json
import sys

import pytest

from sglang_hisparse.config import (
    KNOWN_KEYS,
    HiSparseConfig,
    HiSparseConfigError,
    parse_hisparse_config,
)


def test_no_flag_gives_defaults_resolved_from_the_model():
    config = parse_hisparse_config(None)
    assert config == HiSparseConfig()
    assert not config.is_resolved
    resolved = config.resolve(model_index_topk=2048)
    assert resolved.is_resolved
    assert (resolved.top_k, resolved.device_buffer_size) == (2048, 4096)
    assert (resolved.host_to_device_ratio, resolved.swap_in_block_size) == (2, None)


def test_explicit_values_are_kept():
    text = json.dumps(
        {
            "top_k": 512,
            "device_buffer_size": 1024,
            "host_to_device_ratio": 4,
            "swap_in_block_size": 512,
        }
    )
    resolved = parse_hisparse_config(text).resolve(model_index_topk=512)
    assert resolved == HiSparseConfig(512, 1024, 4, 512)


def test_empty_object_is_all_defaults():
    assert parse_hisparse_config("{}") == HiSparseConfig()


def _error(text: str) -> str:
    with pytest.raises(HiSparseConfigError) as info:
        parse_hisparse_config(text)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "--hisparse-config" in message
    return message


@pytest.mark.parametrize("text", ["{bad", "", "{'top_k': 64}", '{"top_k": 64,}'])
def test_invalid_json(text):
    assert "not valid JSON" in _error(text)


@pytest.mark.parametrize("text", ["[]", "64", '"top_k"', "null", "true"])
def test_non_object_json(text):
    assert "must be a JSON object" in _error(text)


def test_unknown_key_lists_the_known_keys():
    message = _error('{"topk": 64, "page_size": 64}')
    assert "['page_size', 'topk']" in message
    for key in KNOWN_KEYS:
        assert key in message


def test_duplicate_key():
    assert "'top_k' is given twice" in _error('{"top_k": 64, "top_k": 128}')


@pytest.mark.parametrize("key", ["top_k", "device_buffer_size", "host_to_device_ratio"])
@pytest.mark.parametrize("value", [0, -1, 1.5, 64.0, "64", True, False, None, [64]])
def test_sizes_must_be_positive_integers(key, value):
    message = _error(json.dumps({key: value}))
    assert key in message and "positive integer" in message
    assert f"got {json.dumps(value)}" in message


@pytest.mark.parametrize("value", [0, 31, 32, 33, 1000, 1056, 2048, True, 960.0])
def test_swap_in_block_size_bounds(value):
    message = _error(json.dumps({"swap_in_block_size": value}))
    assert "swap_in_block_size must be a multiple of 32 in [64, 1024]" in message


@pytest.mark.parametrize("value", [64, 960, 1024])
def test_swap_in_block_size_accepted(value):
    config = parse_hisparse_config(json.dumps({"swap_in_block_size": value}))
    assert config.swap_in_block_size == value


def test_buffer_smaller_than_explicit_top_k():
    message = _error('{"top_k": 2048, "device_buffer_size": 1024}')
    assert "device_buffer_size (1024) must be >= top_k (2048)" in message


def test_buffer_smaller_than_model_top_k_fails_at_resolve():
    config = parse_hisparse_config('{"device_buffer_size": 1024}')
    with pytest.raises(HiSparseConfigError, match=r"\(1024\) must be >= top_k \(2048\)"):
        config.resolve(model_index_topk=2048)
    # The same buffer is fine for a model with a smaller top-k (DeepSeek-V4: 512).
    assert config.resolve(model_index_topk=512).device_buffer_size == 1024


def test_buffer_equal_to_top_k_is_allowed():
    config = parse_hisparse_config('{"device_buffer_size": 2048}')
    assert config.resolve(2048).device_buffer_size == 2048


def _resolve_error(text: str, model_index_topk: int) -> str:
    config = parse_hisparse_config(text)
    with pytest.raises(HiSparseConfigError) as info:
        config.resolve(model_index_topk=model_index_topk)
    return str(info.value)


def test_block_size_bounds_are_the_kernels():
    # The parser keeps its own copy so that importing it stays torch-free.
    import importlib

    from sglang_hisparse import config

    kernel = importlib.import_module("sglang_hisparse.kernels.swap_in")
    assert (config.MIN_SWAP_IN_BLOCK_SIZE, config.MAX_SWAP_IN_BLOCK_SIZE) == (
        kernel.MIN_BLOCK_SIZE, kernel.MAX_BLOCK_SIZE)


def test_buffer_beyond_the_kernels_int16_lru_fails_at_resolve():
    config = parse_hisparse_config('{"device_buffer_size": 40000}')
    with pytest.raises(HiSparseConfigError,
                       match=r"device_buffer_size must be in \[top_k, 32767\] \(lru is int16\), "
                             r"got 40000 with top_k 2048"):
        config.resolve(model_index_topk=2048)


def test_block_size_too_small_for_the_buffer_fails_at_resolve():
    # 4096 slots over 64 threads would be 64 per thread; the kernel keeps 32.
    message = _resolve_error('{"swap_in_block_size": 64}', 2048)
    assert "swap_in_block_size 64 is too small for device_buffer_size 4096" in message
    assert "at most 32 slots per thread, so swap_in_block_size must be >= 128" in message
    assert parse_hisparse_config('{"swap_in_block_size": 128}').resolve(2048).swap_in_block_size == 128


def test_shared_memory_per_block_is_checked_at_resolve():
    message = _resolve_error('{"device_buffer_size": 16384}', 8192)
    assert "B of shared memory per block; the limit is 232448" in message
    limit = int(message.rsplit("device_buffer_size must be <= ", 1)[1].split()[0])
    assert 8192 <= limit < 16384 and limit % 64 == 0
    parse_hisparse_config(f'{{"device_buffer_size": {limit}}}').resolve(model_index_topk=8192)
    assert "top_k 16384 is too large" in _resolve_error('{"device_buffer_size": 16384}', 16384)


def test_top_k_must_match_the_model():
    message = _resolve_error('{"top_k": 64}', 2048)
    assert "--hisparse-config" in message and "top_k is 64" in message
    assert "index_topk is 2048" in message and "omit top_k or set it to 2048" in message


def test_model_without_index_topk_needs_an_explicit_top_k():
    with pytest.raises(HiSparseConfigError, match="top_k must be given"):
        parse_hisparse_config(None).resolve(model_index_topk=None)
    resolved = parse_hisparse_config('{"top_k": 64}').resolve(model_index_topk=None)
    assert (resolved.top_k, resolved.device_buffer_size) == (64, 128)


def test_config_is_frozen():
    with pytest.raises(Exception):
        HiSparseConfig().top_k = 1  # type: ignore[misc]


def test_parser_does_not_import_sglang():
    # The parser must stay usable (and cheap) without SGLang.
    import subprocess

    code = (
        "import sys, sglang_hisparse.config as c; c.parse_hisparse_config('{}'); "
        "print(any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_env_switches_name_the_variable_and_allowed_values():
    from sglang_hisparse.config import env_problems

    assert env_problems({}) == []
    assert env_problems({"SGLANG_HISPARSE_RESIDENCY": "0", "PATH": "x"}) == []
    problems = env_problems({"SGLANG_HISPARSE_HOST_ALLOC": "huge", "SGLANG_HISPARSE_SKIP_IO": "yes"})
    assert problems == [
        "SGLANG_HISPARSE_SKIP_IO='yes' is not valid; allowed: 0, 1",
        "SGLANG_HISPARSE_HOST_ALLOC='huge' is not valid; allowed: cuda_host_alloc, "
        "registered, registered_thp",
    ]


def test_host_memory_on_cpu_is_plain_and_checks_the_mode(monkeypatch):
    import torch

    from sglang_hisparse.pools import host_memory

    t = host_memory.alloc_pinned((4, 8), torch.bfloat16)
    assert t.shape == (4, 8) and t.dtype == torch.bfloat16
    host_memory.release(t)  # nothing was pinned: a no-op
    monkeypatch.setenv("SGLANG_HISPARSE_HOST_ALLOC", "bogus")
    with pytest.raises(ValueError, match="SGLANG_HISPARSE_HOST_ALLOC must be one of cuda_host_alloc"):
        host_memory.configured_mode()
