"""Admission accounting drift: the request is stopped (or parked), counted,
logged, and the server keeps serving; nothing leaks."""

import torch

from dataplane_fixtures import release
from sglang_hisparse.engine.state import ReqState
from test_coordinator import Env


def _release_all(env, *reqs):
    for req in reqs:
        env.coord.request_finished(req)
        release(env.r2t, env.alloc, req)
    assert env.counts() == env.start


def test_host_pool_exhausted_at_write_through_aborts_that_request_only():
    env = Env()
    a = env.staged("a", 256)  # its second decode step starts a fresh host page
    b = env.staged("b", 100)
    assert env.coord.collect_ready_reqs() == [a, b]
    env.decode([a, b])  # first step after staging: nothing written through
    # Drift: something took every free host page behind the budget's back.
    stolen = env.host.alloc(env.host.available_size())
    env.decode([a, b])
    assert env.coord.accounting_drifts == 1
    assert a.to_finish is not None and "host pool exhausted" in a.to_finish.message
    assert b.to_finish is None  # b's page had room: it keeps decoding
    env.host.free(stolen)
    _release_all(env, a, b)


def test_a_direct_admission_without_rows_for_its_hot_buffer_is_aborted():
    env = Env()
    sub = env.alloc.hisparse_attn_allocator
    # Drift: every free physical row taken behind the budget's back.
    stolen = sub.alloc(sub.raw_available_size())
    a = env.admitted_from_host("a", 300)
    assert env.coord.accounting_drifts == 1 and env.coord.state_of(a) is None
    assert "no physical rows" in a.to_finish.message
    sub.free(stolen)
    b = env.admitted_from_host("b", 300)  # rows are back: the next one is served
    assert env.coord.state_of(b) is ReqState.HOT and b.to_finish is None
    _release_all(env, a, b)


def test_without_an_adapter_drift_raises_a_named_error():
    env = Env()
    env.coord.on_drift = None
    a = env.staged("a", 256)
    assert env.coord.collect_ready_reqs() == [a]
    env.decode([a])
    stolen = env.host.alloc(env.host.available_size())
    try:
        env.decode([a])
    except RuntimeError as exc:
        assert "host pool exhausted" in str(exc) and "a" in str(exc)
    else:
        raise AssertionError("drift went unnoticed")
    env.host.free(stolen)
    assert torch.is_tensor(stolen)


def test_a_host_pool_that_does_not_fit_names_the_key(monkeypatch):
    import psutil
    import pytest

    from sglang_hisparse.adapter.model_runner import build_host_pool
    from dataplane_fixtures import PS, dsa_pool
    from sglang_hisparse.pools.allocator import HiSparseDualAllocator

    pool = dsa_pool(1024)
    alloc = HiSparseDualAllocator(1024, PS, torch.bfloat16, "cpu", pool, False, 2)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=0))
    with pytest.raises(ValueError, match="host_to_device_ratio in --hisparse-config"):
        build_host_pool(alloc, 2)
