"""A PD KV transfer with the real Mooncake transfer engine, on the CPU: a
prefill process laid out as 0.5.13's prefill device pool sends a prompt's
pages over Mooncake's TCP transport on loopback into our host pool, laid out
and registered as a HiSparse decode registers it; the bytes must land at the
host rows the decode's prealloc chose and nowhere else
(tests/pd_transfer_peers.py has the two ends).

The engine is the one the ``pd`` extra installs (``mooncake-transfer-engine-
cuda13``). Its engine.so links the system's libibverbs and libmlx5 (.ci/run
installs them) and the NVIDIA driver's libcuda.so.1. Where no driver is
installed (a CPU-only machine), the peers get one built here from the symbols
engine.so imports, every entry point answering CUDA_ERROR_NO_DEVICE, which
is what a real driver answers on a host without GPUs: CUDA then reports no
device, and the TCP transport treats both buffers as host memory, which
they are.

Skipped, with the loader's error, when the engine cannot be loaded;
``SGLANG_HISPARSE_TEST_REQUIRE_MOONCAKE=1`` (set by .ci/run) makes that a
failure instead, so CI cannot pass without running it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO

PEERS = Path(__file__).with_name("pd_transfer_peers.py")
REQUIRE = "SGLANG_HISPARSE_TEST_REQUIRE_MOONCAKE"
CUDA_ERROR_NO_DEVICE = 100


def _engine_so() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    so = Path(list(spec.submodule_search_locations)[0]) / "engine.so"
    return so if so.exists() else None


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _no_device_driver(out: Path, engine_so: Path) -> Path:
    """A libcuda.so.1 exporting the driver calls engine.so imports, each
    returning CUDA_ERROR_NO_DEVICE (cuGetErrorName/String name that error)."""
    nm = subprocess.run(["nm", "-D", "--undefined-only", str(engine_so)],
                        capture_output=True, text=True, check=True).stdout
    symbols = sorted({line.split()[-1] for line in nm.splitlines()
                      if line.split() and line.split()[-1][:2] == "cu"
                      and line.split()[-1][2:3].isupper()})
    src = ['static const char *no_device = "CUDA_ERROR_NO_DEVICE";']
    for name in symbols:
        if name in ("cuGetErrorName", "cuGetErrorString"):
            src.append(f"int {name}(int e, const char **s) {{ if (s) *s = no_device; return 0; }}")
        else:
            src.append(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}")
    (out / "libcuda.c").write_text("\n".join(src) + "\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(out / "libcuda.so.1"), str(out / "libcuda.c")], check=True)
    return out


def _import_error(env: dict) -> str | None:
    """What doctor reports for the engine, in a fresh interpreter with ``env``."""
    proc = subprocess.run(
        [sys.executable, "-c",
         "from sglang_hisparse import transfer_engine as t; print(t.status().import_error or '')"],
        capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1]
    return proc.stdout.strip() or None


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    """The environment the peers load the engine in, or a skip saying why not."""
    env = dict(os.environ)

    def unavailable(reason):
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {reason}")
        pytest.skip(reason)

    so = _engine_so()
    if so is None:
        unavailable('mooncake transfer engine not installed (pip install -e ".[test]")')
    error = _import_error(env)
    if error and "libcuda.so.1" in error and not _has_driver():
        if not (shutil.which("gcc") and shutil.which("nm")):
            unavailable(f"no NVIDIA driver and no gcc/nm to stand in for it: {error}")
        stub = _no_device_driver(tmp_path_factory.mktemp("no-gpu-driver"), so)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(stub), env.get("LD_LIBRARY_PATH")]))
        error = _import_error(env)
    if error:
        unavailable(f"mooncake transfer engine does not load: {error} (it needs "
                    "libibverbs.so.1 and libmlx5.so.1: apt-get install libibverbs1 ibverbs-providers)")
    return env


class Peer:
    """One end in its own interpreter; ``PEER`` lines from its stdout."""

    def __init__(self, role: str, env: dict):
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, str(PEERS), role], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=str(REPO))
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr),
                         daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("PEER "):
                self.lines.put(json.loads(line[5:]))
        self.lines.put(None)  # exited

    # The first answer comes after SGLang's imports, which take 20-30 s on
    # an idle 2-core machine and over a minute on a loaded one (a 60 s wait
    # failed there while the other xdist worker ran the soak).
    def expect(self, timeout=240) -> dict:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            msg = None
        assert msg is not None, f"{self.role} gave no answer:\n" + "".join(self.stderr[-40:])
        return msg

    def tell(self, msg: dict):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def close(self):
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_prefill_pages_land_at_the_host_rows_the_decode_prealloc_chose(engine_env):
    # Both start at once: each spends most of its time importing SGLang.
    decode, prefill = Peer("decode", engine_env), Peer("prefill", engine_env)
    try:
        registered = decode.expect()
        sender = prefill.expect()
        # One transfer item is one page on both sides: the prefill's device
        # page (64 rows of the same KV dtype) is the host pool's page.
        assert sender["src_item_lens"] == registered["dst_item_lens"]
        # The prealloc took the free host pages in free-list order.
        assert registered["dst_pages"] == registered["free_pages"]
        prefill.tell(registered)
        sent = prefill.expect()
        decode.tell({})
        result = decode.expect()
    finally:
        decode.close()
        prefill.close()
    assert sent["ret"] == 0, prefill.stderr[-20:]
    assert sent["ret_beyond"] != 0  # a send the engine refuses is reported as such
    assert result["landed"] == [True, True], result
    assert result["rows_changed_elsewhere"] == [0, 0], result
    assert decode.proc.returncode == 0 and prefill.proc.returncode == 0


def test_doctor_reports_the_engine_it_loaded_and_its_transports(engine_env):
    # The doctor's section, in the environment the peers ran in.
    proc = subprocess.run(
        [sys.executable, "-c",
         "from sglang_hisparse import transfer_engine as t\n"
         "print('\\n'.join(t.status_lines(t.status())))"],
        capture_output=True, text=True, env=engine_env, cwd=str(REPO), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "build     mooncake-transfer-engine-cuda13 " in out
    assert "import    OK mooncake.engine.TransferEngine" in out
    assert "tcp       yes" in out
    from sglang_hisparse.transfer_engine import verbs_devices

    assert ("rdma      yes" if verbs_devices() else "rdma      no ") in out


# --- the prefill's transfer worker (the manifest's transfer_worker patch)
@pytest.mark.parametrize("extra_rc,want", [(0, "Success"), (-1, "Failed")])
def test_a_failed_state_transfer_fails_the_request(extra_rc, want):
    """0.5.13's ``MooncakeKVManager.transfer_worker`` as the plugin installs it,
    on the last chunk of a request with DSA state (the indexer K): its
    ``maybe_send_extra`` failing must fail the request on both sides (0.5.13
    dropped the return code and reported Success). The manager is 0.5.13's
    (status, failure records and the worker's control flow are its own code);
    what would touch the network here (the KV, state and aux sends, the
    status sent to the decode) answers with the given return codes: the
    Mooncake engine cannot be loaded on a machine without the verbs
    libraries, and the engine-level failure itself is covered above."""
    import threading
    from collections import defaultdict
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, TransferInfo

    from sglang_hisparse.manifest import ENTRIES
    from sglang_hisparse.pinned_source import sglang_version
    from sglang_hisparse.plugin import check_entry

    (entry,) = [e for e in ENTRIES if e.target.endswith("MooncakeKVManager.transfer_worker")]
    if entry.applies_to(sglang_version()):
        check = check_entry(entry, sglang_version())
        assert check.ok, check.detail
        transfer_worker = check.hook
    else:  # the release fails the request itself (0.5.17 mooncake/conn.py:1738-1766)
        assert entry.native_in and not entry.applies_to(entry.native_in)
        transfer_worker = MooncakeKVManager.transfer_worker
    room, session = 4242, "127.0.0.1:15000"
    mgr = object.__new__(MooncakeKVManager)
    synced = []
    kv_args = KVArgs()  # 0.5.17 skips the KV send without registered KV buffers
    kv_args.kv_data_ptrs = [0]
    mgr.__dict__.update(
        enable_trace=False, enable_staging=False, request_status={room: KVPoll.Transferring},
        failure_records={}, failure_lock=threading.Lock(), session_lock=threading.Lock(),
        failed_sessions=set(), session_failures=defaultdict(int), req_to_decode_prefix_len={},
        is_mla_backend=True, is_hybrid_mla_backend=False, kv_args=kv_args, attn_tp_rank=0, attn_tp_size=1, pp_size=1, pp_rank=0,
        attn_cp_size=1, attn_cp_rank=0, bootstrap_port=8998,
        decode_kv_args_table={session: type("Reg", (), {"dst_kv_ptrs": [0], "dst_aux_ptrs": [0],
                                                        "dst_attn_tp_size": 1,
                                                        # 0.5.17 reads these too
                                                        "requires_dcp_relayout": False,
                                                        "dst_kv_layer_ids": []})()},
        transfer_infos={room: {session: TransferInfo(
            room=room, endpoint="127.0.0.1", dst_port=17000, mooncake_session_id=session,
            dst_kv_indices=np.arange(2, dtype=np.int32), dst_aux_index=0,
            dst_state_indices=[[3, 4]], required_dst_info_num=1, is_dummy=False)}},
        send_kvcache=lambda *a, **kw: 0, send_aux=lambda *a, **kw: 0,
        maybe_send_extra=lambda *a, **kw: extra_rc,
        sync_status_to_decode_endpoint=lambda ep, port, r, status, rank: synced.append(status))
    work = FastQueue()
    work.put(TransferKVChunk(room=room, prefill_kv_indices=np.arange(2, dtype=np.int32),
                             index_slice=slice(0, 2), is_last_chunk=True, prefill_aux_index=0,
                             state_indices=[[5, 6]]))
    worker = threading.Thread(target=transfer_worker, args=(mgr, work, ThreadPoolExecutor(1)),
                              daemon=True)
    worker.start()
    for _ in range(500):
        if synced:
            break
        threading.Event().wait(0.01)
    status = getattr(KVPoll, want)
    assert synced == [status]
    assert mgr.request_status.get(room, KVPoll.Success) == status
    assert (room in mgr.failure_records) == (want == "Failed")
