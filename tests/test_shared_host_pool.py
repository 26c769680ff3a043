"""One host pool per node shared by the local TP ranks (#22 item 2, CPU part).

Separate processes map the segment of ``pools/shared_host_memory.py`` the
way the TP ranks of one node would: the leader creates it, followers attach
and see the leader's bytes, a follower killed mid-way disturbs nobody and
leaks nothing, and nothing is left in /dev/shm once all are gone. Then the
adapter's wiring: two gloo ranks build our real DSA host pool over it with
SGLANG_HISPARSE_SHARED_HOST_POOL=1, and rank 1 reads what rank 0's
write-through copied. The arg rules: PD decode refused, the host-memory
check through real ServerArgs counting the pool once per node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from conftest import REPO, run_ranks
from sglang_hisparse.pools.shared_host_memory import (
    SharedHostPoolError,
    leftovers,
    open_shared_buffer,
)

NBYTES = 1 << 16
# The ``name`` fixture's segments. Not under the adapter's NAME_PREFIX: the
# wiring test counts every segment of that prefix, and under ``pytest -n 2``
# the other worker may hold one of these meanwhile (CI, 2026-12-07).
TEST_PREFIX = "hisparse_shm_test_"


@pytest.fixture
def name():
    """A segment name of this test only; nothing of it may outlive the test."""
    n = f"{TEST_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
    yield n
    left = leftovers(n)
    for entry in left:
        os.unlink(os.path.join("/dev/shm", entry))
    assert left == [], f"left in /dev/shm: {left}"


def _touch(sync: str, what: str, text: str = "") -> None:
    with open(os.path.join(sync, what + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(sync, what + ".tmp"), os.path.join(sync, what))


def _wait(sync: str, what: str, timeout: float = 120.0) -> str:
    path = os.path.join(sync, what)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)
    with open(path) as f:
        return f.read()


def worker(name: str, rank: int, ranks: int, nbytes: int, sync: str) -> None:
    """One local rank: the leader writes two patterns, a follower reports
    what it sees after each."""
    if rank == 0:
        _wait(sync, "create")  # the test may kill the leader before this
    t = open_shared_buffer(name, (nbytes,), torch.uint8, local_rank=rank, local_ranks=ranks,
                           timeout_s=float(os.environ.get("SHARED_TEST_TIMEOUT", "60")))
    _touch(sync, f"attached.{rank}")
    if rank == 0:
        t[:256] = 1
        _touch(sync, "wrote1")
        _wait(sync, "go2")
        t[256:512] = 2
        _touch(sync, "wrote2")
    else:
        _wait(sync, "wrote1")
        first = bool((t[:256] == 1).all()) and not bool((t[256:512] == 2).any())
        _touch(sync, f"seen1.{rank}", json.dumps(first))
        _wait(sync, "wrote2")
        _touch(sync, f"seen2.{rank}", json.dumps(bool((t[256:512] == 2).all())
                                                 and bool((t[:256] == 1).all())))
    _wait(sync, "done")


def _start(name: str, rank: int, ranks: int, sync, nbytes: int = NBYTES, env=None):
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        import test_shared_host_pool as t
        t.worker({name!r}, {rank}, {ranks}, {nbytes}, {str(sync)!r})
    """)
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                            cwd=str(REPO), env={**os.environ, **(env or {})})


def test_followers_see_the_leaders_writes_and_a_killed_one_leaks_nothing(tmp_path, name):
    sync = str(tmp_path)
    procs = [_start(name, rank, 3, sync) for rank in range(3)]
    try:
        _touch(sync, "create")
        for rank in (1, 2):
            assert json.loads(_wait(sync, f"seen1.{rank}")) is True
        # Every rank attached: the segment is already unlinked, the mappings live.
        assert leftovers(name) == []
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(timeout=60)
        _touch(sync, "go2")
        assert json.loads(_wait(sync, "seen2.1")) is True
        assert not os.path.exists(os.path.join(sync, "seen2.2"))
        _touch(sync, "done")
        for p in procs[:2]:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[2].returncode == -signal.SIGKILL
    assert leftovers(name) == []


def test_the_leader_dying_before_it_creates_gives_followers_a_clear_error(tmp_path, name):
    sync = str(tmp_path)
    env = {"SHARED_TEST_TIMEOUT": "3"}
    leader = _start(name, 0, 2, sync, env=env)
    follower = _start(name, 1, 2, sync, env=env)
    leader.send_signal(signal.SIGKILL)  # it waits for "create", which never comes
    leader.wait(timeout=60)
    started = time.monotonic()
    _, err = follower.communicate(timeout=120)
    assert follower.returncode != 0
    assert "SharedHostPoolError" in err and "did not create it within 3 s" in err, err[-2000:]
    assert "local TP rank 0" in err
    assert time.monotonic() - started < 90
    assert leftovers(name) == []


def _leader_in_thread(name, ranks, nbytes, timeout_s):
    result = {}

    def run():
        try:
            result["tensor"] = open_shared_buffer(name, (nbytes,), torch.uint8, local_rank=0,
                                                  local_ranks=ranks, timeout_s=timeout_s)
        except Exception as exc:  # reported to the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_a_size_mismatch_names_both_sizes(name):
    thread, leader = _leader_in_thread(name, 2, NBYTES, timeout_s=2)
    with pytest.raises(SharedHostPoolError, match=f"expects {2 * NBYTES} bytes but the leader "
                                                  f"created {NBYTES} bytes"):
        open_shared_buffer(name, (2 * NBYTES,), torch.uint8, local_rank=1, local_ranks=2,
                           timeout_s=30)
    thread.join(timeout=60)
    # The follower never attached: the leader gives up, unlinks and says who is missing.
    assert "local rank(s) [1] did not attach" in str(leader["error"])
    assert leftovers(name) == []


def test_a_follower_in_the_same_process_maps_the_same_bytes(name):
    thread, leader = _leader_in_thread(name, 2, NBYTES, timeout_s=30)
    follower = open_shared_buffer(name, (NBYTES // 2,), torch.int16, local_rank=1,
                                  local_ranks=2, timeout_s=30)
    thread.join(timeout=60)
    assert "error" not in leader and leftovers(name) == []
    leader["tensor"][:4] = torch.tensor([1, 0, 2, 0], dtype=torch.uint8)
    assert follower[:2].tolist() == [1, 2]  # one memory, not two copies


# --- the adapter's wiring: our DSA host pool over the shared buffer ---------


def run_pool_rank(rank: int, init_file: str) -> dict:
    import torch.distributed as dist

    from dataplane_fixtures import PS, dsa_pool
    from sglang_hisparse.adapter.model_runner import shared_host_buffer_allocator
    from sglang_hisparse.pools.host import HiSparseMLAHostPool

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    device = dsa_pool(size=256, layers=2)
    host = HiSparseMLAHostPool(device, host_to_device_ratio=1, page_size=PS,
                               alloc_host_buffer=shared_host_buffer_allocator(dist.group.WORLD))
    gen = torch.Generator().manual_seed(7)
    for layer in range(2):
        buf = device.kv_buffer[layer]
        buf.view(torch.int16).copy_(torch.randint(-2000, 2000, buf.shape, generator=gen,
                                                  dtype=torch.int16).view(buf.shape))
    host_rows, device_rows = torch.arange(64, 128), torch.arange(0, 64)
    if rank == 0:  # the only rank writing
        host.backup_from_device_all_layer(device, host_rows, device_rows)
    dist.barrier()
    seen = all(torch.equal(host.kv_buffer[layer][host_rows].view(torch.int16),
                           device.kv_buffer[layer][device_rows].view(torch.int16))
               for layer in range(2))
    untouched = bool((host.kv_buffer[:, :64].view(torch.int16) == 0).all())
    dist.barrier()
    host.destroy()
    dist.destroy_process_group()
    return dict(seen=seen, untouched=untouched, size=host.size)


def test_two_tp_ranks_build_our_host_pool_over_one_buffer(tmp_path):
    before = set(leftovers())
    init = str(tmp_path / "init")
    results = run_ranks("test_shared_host_pool",
                        [f"run_pool_rank({rank}, {init!r})" for rank in range(2)],
                        env={"SGLANG_HISPARSE_SHARED_HOST_POOL": "1"})
    # Rank 1 wrote nothing, yet holds rank 0's rows: one buffer (a private
    # pool per rank would leave rank 1's rows zero).
    assert [r["seen"] for r in results] == [True, True]
    assert [r["untouched"] for r in results] == [True, True]
    assert results[0]["size"] == results[1]["size"] >= 256
    assert set(leftovers()) <= before


# --- arg rules and the host-memory check -----------------------------------


def test_the_switch_takes_0_or_1():
    from sglang_hisparse.config import env_problems

    assert env_problems({"SGLANG_HISPARSE_SHARED_HOST_POOL": "1"}) == []
    (problem,) = env_problems({"SGLANG_HISPARSE_SHARED_HOST_POOL": "yes"})
    assert "SGLANG_HISPARSE_SHARED_HOST_POOL='yes'" in problem and "0, 1" in problem
