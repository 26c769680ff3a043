#!/usr/bin/env python3
"""PD disaggregation end to end on one GPU: a real 0.5.13 prefill server sends
KV over Mooncake (TCP on loopback) into HiSparse decode servers (issue #18,
items 3-5).

Reuses scripts/e2e_gpu.py's server launch (``server_cmd``/``Server``), its
workloads, log parsing, exactness comparison and tables; what this script adds
is the PD wiring: a prefill server, decode servers, and a small router.

Servers, all on the one GPU (each capped by ``--mem-fraction-static`` and
``--max-total-tokens``), launched together at the start (a launch is ~1 min of
Python imports; the KV pools are small, so memory profiling tolerates the
others' allocations) and stopped as soon as their part is done:

  prefill     e2e's ``base`` (no HiSparse) + ``--disaggregation-mode prefill
              --disaggregation-transfer-backend mooncake_tcp``
  colo-base   e2e's ``base``, colocated: the reference outputs
  pd-ours     decode ``--enable-hisparse`` (``--check``: SGLANG_HISPARSE_CHECK=1),
              KV from the prefill
  pd-wide     decode without HiSparse whose device pool holds every request
              of a workload at once (--max-total-tokens 300000), as
              HiSparse's hot buffers let pd-ours run them: the control for
              what a different batch composition alone does to logprobs
  pd-fake     decode ``--enable-hisparse --disaggregation-transfer-backend fake``,
              sent the requests directly (no bootstrap host: 0.5.13's fake
              transfer moves no bytes), the negative control: outputs must diverge
  pd-retract  pd-ours with SGLANG_TEST_RETRACT=1 (0.5.13's own switch: retract
              every SGLANG_TEST_RETRACT_INTERVAL forwards): requests retract,
              keep their KV on host, resume
  pd-press    pd-ours with a host pool smaller than the workload grows into
              (ratio 1): retraction under real memory pressure
  pd-base     decode without HiSparse at the capacity pair's --max-total-tokens
  pd-cap      pd-ours at the same --max-total-tokens (no --check: timed)

The router (``Router``) does what 0.5.13's mini load balancer does
(sglang_router mini_lb): the same ``/generate`` body plus ``bootstrap_host``,
``bootstrap_port`` and a random 63-bit ``bootstrap_room`` goes to the prefill
and to the decode at the same time; the client gets the decode's answer (its
status, its stream), with the prefill's ``input_token_logprobs`` merged in
front of the decode's when logprobs are asked for. One log line per request:
room, prompt length, both statuses, milliseconds.

Parts (``--parts``, default all; each skipped when ``--budget-s`` no longer
covers its estimate, and the JSON is rewritten after each):

  exact    colo-base, pd-ours (with --check), pd-wide and pd-fake on smoke,
           concurrent, capacity: pd-ours identical to colo-base below
           index_topk (every token of the 600-token prompt), the in-server
           check at 0 mismatches with checks > 0, pd-fake diverges, and above
           index_topk pd-ours' logprobs within --tol of colo-base's, or, on a
           workload where they are not, no further from them than pd-wide's
           are (colo-base runs 2 of capacity's 16 prompts at a time, pd-ours
           up to 16: the GEMMs of another batch size round differently in
           bf16, which moves logprobs by whole bf16 steps of the logits,
           1/64 at the kit model's logit scale, whether HiSparse runs or not)
  retract  pd-retract (with --check) and pd-press on ``pdretract`` (8 x 2000
           tokens x 1200 out) against colo-base: every request finished with
           colo-base's outputs, and after a last short request the pools back
           at the start (``#cpu token`` no more than that request's own pages,
           no request in prealloc, transfer or retracted queues); pd-retract
           must retract (and resume) and its in-server check be exact;
           pd-press is expected to hold later prompts in the prealloc queue
           (the PD host budget) instead of retracting: its retractions and
           prealloc waits are reported, not required
  faults   (run last: it kills the prefill) on pd-fault (16384 device rows):
           4 requests whose clients hang up 0.3 s in, while their transfers
           are in flight; a prompt longer than the decode's device pool (a
           400 naming the sizes); the prefill SIGKILLed while 8 transfers are
           queued or in flight (the decode fails them, and serves the next
           request once a new prefill is up); each followed by a request
           that must succeed, and at the end the pools back at the start
  capacity pd-base vs pd-cap on ``pdbound`` (32000-token prompts x 2048 out,
           --max-total-tokens 72000: pd-base holds two): decode-only tok/s
           from each decode server's log (e2e's decode-only figure), ratio
           (target >= 3x)
  v4draft  (not in the default; issue #19 item 4) DeepSeek-V4 (``--v4-model``,
           tests/data/tiny-dsv4) with linear EAGLE on both sides: a pair with
           our plugin (the draft's SWA state registered for the transfer), a
           stock pair (e2e's bare: every plugin but ours, no HiSparse; 0.5.13
           leaves it out) on its own bootstrap port, and a colocated V4 + EAGLE
           reference, on ``smoke``.
           scripts/draftprobe records each side's digest of the request's draft
           SWA window: equal for every request in ours, different for every
           one in stock; ours' outputs identical to the reference below
           index_topk
  v4hs     (not in the default; issue #19 item 4) DeepSeek-V4 (``--v4-model``)
           with HiSparse on the decode node: a plain V4 prefill on its own
           bootstrap port, our V4 decode with the in-server check and forced
           retraction (SGLANG_TEST_RETRACT), and a colocated V4 reference, on
           ``pdretract``. The decode must retract and resume (its C4 rows kept
           on host, the device state restored: engine/retained_device_state.py),
           its check cover C4 rows with 0 mismatches, every request finish,
           the pools come back (probe), and the outputs match the reference
           below index_topk (512 C4 rows, 2048 tokens)

    source .gpu/device_env.sh
    SGLANG_HOST_IP=127.0.0.1 python3 scripts/pd_gpu.py --out $OUT/pd.json --logs $OUT/pd

scripts/gpu_stages.sh's ``pd`` stage runs it (Mooncake from .bundle/mooncake.tar.xz).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_gpu as e2e  # noqa: E402

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX  # noqa: E402 (the /health requests' rid)
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST  # noqa: E402 (what 0.5.13's warm-up sends)

BOOTSTRAP_PORT = 8998
PAGE = 64
INDEX_TOPK = e2e.SHORT_TOKENS  # the DSA models' index_topk (e2e_gpu.py says why it is one figure)

# PD workloads beside e2e's (same tuple shape: groups, output tokens, flags).
e2e.WORKLOADS.setdefault("pdretract", ([[2000] * 8], 1200, []))
e2e.WORKLOADS.setdefault("pdbound", ([[32000] * 16], 2048, ["--max-total-tokens", "72000",
                                                             "--context-length", "40960"]))

# Every server: the env the PD path needs (these are read by the launcher and
# inherited by its scheduler processes).
PD_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "MC_FORCE_TCP": "1",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
}

CAPACITY_TARGET = 3.0
SHORT_FLAGS = ["--max-total-tokens", "40000"]
LONG_FLAGS = ["--max-total-tokens", "72000", "--context-length", "40960"]
# Room for capacity's 16 x (16000 + 128) tokens at once, without HiSparse.
WIDE_FLAGS = ["--max-total-tokens", "300000"]
HS_TIGHT = {"top_k": INDEX_TOPK, "device_buffer_size": 2048, "host_to_device_ratio": 1}

# Part v4draft (issue #19 item 4): DeepSeek-V4 with linear EAGLE on both PD
# sides, and scripts/draftprobe (a diagnostic plugin) recording the draft SWA
# window's digest as each side holds it. The stock pair (config bare: every
# plugin but ours, so 0.5.13's registration alone) has its own bootstrap port.
V4_MODEL = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny-dsv4"
V4_MTP = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
          "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
V4_STOCK_BOOTSTRAP_PORT = BOOTSTRAP_PORT + 1
DRAFTPROBE_DIR = Path(__file__).resolve().parent / "draftprobe"
# Part v4hs: V4 with HiSparse on the decode node; its own bootstrap port, so
# it can run beside the other parts' prefills.
V4HS_BOOTSTRAP_PORT = BOOTSTRAP_PORT + 2


# --- router ------------------------------------------------------------------

class Router:
    """0.5.13's mini_lb in a thread: ``/generate`` to prefill and decode at once."""

    def __init__(self, port: int, decode_url: str, prefill_url: Optional[str],
                 bootstrap_port: int = BOOTSTRAP_PORT, log=print):
        # prefill_url None: the fake-transfer control. 0.5.13's decode builds a
        # receiver for every request and crashes on bootstrap_host None
        # (NetworkAddress.__post_init__); its own PD warm-up sends
        # FAKE_BOOTSTRAP_HOST with a room, so this does the same.
        self.decode_url, self.prefill_url = decode_url, prefill_url
        self.bootstrap_port = bootstrap_port
        self.log = log
        self.counts = {"requests": 0, "prefill_errors": 0, "decode_errors": 0}
        self.lines: list[str] = []
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def log_message(self, *a):  # our own line per request instead
                pass

            def do_GET(self):
                try:
                    with urllib.request.urlopen(router.decode_url + self.path, timeout=10) as r:
                        body, status = r.read(), r.status
                except urllib.error.HTTPError as exc:
                    body, status = exc.read(), exc.code
                except Exception as exc:
                    body, status = repr(exc).encode(), 503
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                router.generate(self, json.loads(raw or b"{}"))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    @staticmethod
    def _post(url: str, body: dict, timeout: float = 900):
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=timeout)

    def _prefill(self, body: dict, result: dict):
        """Post to the prefill and keep its input_token_logprobs (from any chunk)."""
        try:
            with self._post(self.prefill_url + "/generate", body) as r:
                result["status"] = r.status
                for raw in r:
                    line = raw.decode(errors="ignore").strip()
                    if line.startswith("data:") and line != "data: [DONE]":
                        chunk = json.loads(line[5:])
                    elif line.startswith("{"):
                        chunk = json.loads(line)
                    else:
                        continue
                    lp = (chunk.get("meta_info") or {}).get("input_token_logprobs")
                    if lp and "input_token_logprobs" not in result:
                        result["input_token_logprobs"] = lp
        except urllib.error.HTTPError as exc:
            result["status"] = exc.code
            result["error"] = exc.read()[:300].decode(errors="ignore")
        except Exception as exc:
            result["status"] = None
            result["error"] = repr(exc)[:300]
        finally:
            result["done"].set()

    def generate(self, handler, body: dict):
        t0 = time.time()
        self.counts["requests"] += 1
        prefill = {"done": threading.Event()}
        room = None
        if self.prefill_url:
            room = random.getrandbits(63)
            body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=self.bootstrap_port,
                        bootstrap_room=room)
            threading.Thread(target=self._prefill, args=(body, prefill), daemon=True).start()
        else:
            room = random.getrandbits(63)
            body = dict(body, bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=room)
            prefill["done"].set()
        want_lp = bool(body.get("return_logprob"))
        status, n_chunks = None, 0
        try:
            resp = self._post(self.decode_url + "/generate", body)
            status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
            resp = None
            payload = exc.read()
        except Exception as exc:
            status, resp, payload = 502, None, repr(exc).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "text/event-stream" if body.get("stream")
                                else "application/json")
            handler.end_headers()
            if resp is None:
                handler.wfile.write(payload)
            else:
                merged = False
                with resp:
                    for raw in resp:
                        line = raw.decode(errors="ignore")
                        s = line.strip()
                        if want_lp and not merged and (s.startswith("data:") and s != "data: [DONE]"
                                                       or s.startswith("{")):
                            line = self._merge(s, prefill) + "\n"
                            merged = True
                        handler.wfile.write(line.encode())
                        handler.wfile.flush()
                        n_chunks += 1
        except (BrokenPipeError, ConnectionResetError):
            status = f"{status} (client gone)"
        if status != 200:
            self.counts["decode_errors"] += 1
        prefill["done"].wait(timeout=5)
        if prefill.get("status") not in (None, 200) or prefill.get("error"):
            self.counts["prefill_errors"] += 1
        line = (f"router: room={room} prompt={len(body.get('input_ids') or [])} "
                f"prefill={prefill.get('status')}{' ' + prefill['error'] if prefill.get('error') else ''} "
                f"decode={status} chunks={n_chunks} {1000 * (time.time() - t0):.0f} ms")
        self.lines.append(line)
        self.log(line)

    @staticmethod
    def _merge(s: str, prefill: dict) -> str:
        """The decode's first chunk with the prefill's input_token_logprobs in front."""
        prefill["done"].wait(timeout=60)
        sse = s.startswith("data:")
        chunk = json.loads(s[5:] if sse else s)
        mi = chunk.setdefault("meta_info", {})
        mi["input_token_logprobs"] = (prefill.get("input_token_logprobs") or []) + (
            mi.get("input_token_logprobs") or [])
        return ("data: " if sse else "") + json.dumps(chunk)


# --- servers -------------------------------------------------------------------

def free_port(start: int) -> int:
    for port in range(start, start + 500):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port from {start}")


class Node:
    """One server of the run: what it is, its e2e.Server, its log."""

    def __init__(self, name, config, flags, logs, model, hs_config=None, check=False,
                 env=None, server_args=()):
        self.name, self.config = name, config
        self.port = free_port(31000 + 20 * len(_NODES))
        self.log = Path(logs) / f"server_{name}.log"
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.srv = e2e.Server(model, self.port, config, list(flags), self.log,
                                  hs_config=hs_config, check=check,
                                  server_args=list(server_args))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.url = self.srv.url
        self.ready_s: Optional[float] = None
        self.error: Optional[str] = None
        self.stopped = False
        _NODES.append(self)

    def wait_ready(self, timeout=420):
        try:
            self.ready_s = self.srv.wait_ready(timeout)
        except Exception as exc:
            self.error = repr(exc)
        print(f"[{self.name}] " + (f"ready in {self.ready_s:.0f} s" if self.ready_s is not None
                                   else f"FAILED to start: {self.error}"), flush=True)
        return self.ready_s is not None

    def text(self, since: int = 0) -> str:
        return self.log.read_text(errors="ignore")[since:] if self.log.exists() else ""

    def mark(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def stop(self):
        if not self.stopped:
            self.srv.stop()
            self.stopped = True


_NODES: list[Node] = []


def stop_all():
    # Every server told first, then each waited for: one after the other
    # they take up to 30 s each (e2e_gpu.serve_together does the same).
    for n in _NODES:
        if not n.stopped:
            n.srv.terminate()
    for n in _NODES:
        n.stop()


# --- decode-log facts --------------------------------------------------------

_DECODE_LINE = re.compile(r"Decode batch.*")


# What 0.5.13 logs once at start-up (so found in the whole log, not in the
# part since a workload's mark): its PD hook's rewrite of ``mooncake_tcp``
# (arg_groups/pd_disaggregation_hook.py:24) or the Mooncake engine's own
# choice (transfer_engine_impl.cpp), and the decode's forced chunk cache (:56).
_TCP_TRANSPORT = re.compile(r"MC_FORCE_TCP is set, using TCP transport only"
                            r"|with MC_FORCE_TCP=1 \(TCP transport, no RDMA\)")
_CHUNK_CACHE_FORCED = "KV cache is forced as chunk cache for decode server"


def decode_facts(text: str, startup: str | None = None) -> dict:
    """What a PD decode server's log says: transfers failed, retractions,
    queue lengths and host tokens of its last decode log line (from
    ``text``, the log since a mark), and how it started (from ``startup``,
    the whole log; ``text`` when not given)."""
    startup = text if startup is None else startup
    lines = _DECODE_LINE.findall(text)
    last = lines[-1] if lines else ""

    def field(name):
        m = re.search(re.escape(name) + r": ([\d.]+)", last)
        return float(m.group(1)) if m else None

    retracts = [int(x) for x in re.findall(r"Retract requests\. #retracted_reqs: (\d+)", text)] + \
        [int(x) for x in re.findall(r"Testing retraction\. #retracted_reqs: (\d+)", text)]
    return {
        "transfer_failed": text.count("Decode transfer failed"),
        "retractions": sum(retracts),
        "retraction_events": len(retracts),
        "oom_aborts": text.count("aborted last request"),
        "max_retracted_req": max((int(x) for x in re.findall(r"#retracted-req: (\d+)", text)),
                                 default=None),
        "last_cpu_token": field("#cpu token"),
        "last_prealloc_req": field("#prealloc-req"),
        "last_transfer_req": field("#transfer-req"),
        "last_retracted_req": field("#retracted-req"),
        "last_running_req": field("#running-req"),
        "tcp_transport": bool(_TCP_TRANSPORT.search(startup)),
        "chunk_cache_forced": _CHUNK_CACHE_FORCED in startup,
        # tracebacks other than 0.5.13's benign start-up one (a count; 0: none)
        "traceback": e2e.count_tracebacks(text)["other"],
        "max_prealloc_req": max((int(x) for x in re.findall(r"#prealloc-req: (\d+)", text)),
                                default=None),
        "drift": re.findall(r"#hisparse drift: (\d+)", text)[-1:] or None,
    }


def probe_after(node_url: str, flags_note: str = "") -> dict:
    """A last short request (600 tokens, 16 out): it must succeed, and the
    decode log lines it prints show the pools with only it in them."""
    try:
        r = e2e.stream_generate(node_url, e2e.make_ids(600, 4242), 16, timeout=180)
        time.sleep(1.0)
        return {"ok": len(r["output_ids"] or []) == 16, "output_ids": r["output_ids"]}
    except Exception as exc:
        return {"ok": False, "error": repr(exc)[:300]}


def pools_back(facts: dict) -> Optional[bool]:
    """After the probe: only the probe's pages on host, every queue empty."""
    if facts["last_cpu_token"] is None:
        return None
    probe_pages = -(-(600 + 16) // PAGE) * PAGE
    return (facts["last_cpu_token"] <= probe_pages and not facts["last_prealloc_req"]
            and not facts["last_transfer_req"] and not facts["last_retracted_req"])


# --- comparisons --------------------------------------------------------------

def within_topk_tokens(prompt_len: int) -> int:
    """How many output tokens are produced while the context still fits in
    index_topk: token i attends over prompt_len + i positions, so below that
    every position is selected and no top-k choice can differ. Past it two
    launches of the same baseline may select, and so decode, differently."""
    return max(0, INDEX_TOPK - prompt_len)


def identical_requests(ref: dict, other: dict) -> dict:
    """Per prompt length: how many requests produced exactly ref's tokens, and
    how many agree on every token produced while the context fit in index_topk."""
    out: dict = {}
    for a, b in zip(ref["requests"], other["requests"]):
        k = str(a["prompt_len"])
        d = out.setdefault(k, {"n": 0, "identical": 0, "identical_within_topk": 0,
                               "first_token_equal": 0})
        d["n"] += 1
        d["identical"] += (a["output_ids"] == b["output_ids"])
        n = within_topk_tokens(a["prompt_len"])
        d["identical_within_topk"] += (a["output_ids"][:n] == b["output_ids"][:n])
        d["first_token_equal"] += bool(a["output_ids"] and b["output_ids"]
                                       and a["output_ids"][0] == b["output_ids"][0])
    return out


def exactness(ref: dict, other: dict, args) -> dict:
    cmp = e2e.compare(ref, other, args.margin, args.tol)
    cmp["by_prompt_len"] = identical_requests(ref, other)
    below = [v for k, v in cmp["by_prompt_len"].items() if int(k) < INDEX_TOPK]
    # A prompt below index_topk whose output runs past it (v4hs: 2000 + 1200)
    # is judged on the tokens decoded before it got there.
    cmp["below_topk_identical"] = (all(v["identical_within_topk"] == v["n"] for v in below)
                                   if below else None)
    return cmp


def run(node_url: str, workload: str, **kw) -> dict:
    r = e2e.run_workload(node_url, workload, **kw)
    print(f"   {workload}: {len(r['requests'])} ok, {len(r['errors'])} errors, "
          f"{r['output_tok_s']:.0f} tok/s, wall {r['wall_s']:.1f} s", flush=True)
    return r


# --- parts -------------------------------------------------------------------

ESTIMATE_S = {"exact": 160, "retract": 60, "faults": 120, "capacity": 90, "v4draft": 90,
              "v4hs": 90}
EXACT_WORKLOADS = ("smoke", "concurrent", "capacity")


def part_exact(nodes, results, args):
    verdict = {}
    colo, ours, fake = nodes["colo-base"], nodes["pd-ours"], nodes["pd-fake"]
    ref = {w: run(colo.url, w)
           for w in EXACT_WORKLOADS + (("pdretract",) if "retract" in args.parts else ())}
    results["colo-base"] = ref
    if "retract" not in args.parts:
        colo.stop()
    router = Router(free_port(32000), ours.url, nodes["prefill"].url)
    try:
        mark = ours.mark()
        got = {w: run(router.url, w) for w in EXACT_WORKLOADS}
        e2e.flush_counters(router.url)
        time.sleep(1.0)
    finally:
        router.close()
    text = ours.text(mark)
    stats = e2e.log_stats(ours.log, 0)
    results["pd-ours"] = got
    verdict["pd-ours"] = {
        "exactness": {w: exactness(ref[w], got[w], args) for w in EXACT_WORKLOADS},
        "errors": sum(len(got[w]["errors"]) for w in EXACT_WORKLOADS),
        "check": e2e.check_verdict("ours", stats) if args.check else None,
        "exact_checked": stats.get("exact_checked"), "exact_mismatch": stats.get("exact_mismatch"),
        "hisparse_misses": stats.get("hisparse_misses"),
        "decode_log": decode_facts(text, ours.text()), "router": dict(router.counts),
    }
    ours.stop()
    wide = nodes["pd-wide"]
    router = Router(free_port(32200), wide.url, nodes["prefill"].url)
    try:
        got_wide = {w: run(router.url, w) for w in EXACT_WORKLOADS}
    finally:
        router.close()
    results["pd-wide"] = got_wide
    verdict["pd-wide"] = {
        "exactness": {w: exactness(ref[w], got_wide[w], args) for w in EXACT_WORKLOADS},
        "errors": sum(len(got_wide[w]["errors"]) for w in EXACT_WORKLOADS)}
    verdict["pd-ours"]["vs_pd_wide"] = {w: exactness(got_wide[w], got[w], args)
                                        for w in EXACT_WORKLOADS}
    wide.stop()
    mark = fake.mark()
    fake_router = Router(free_port(32100), fake.url, None)
    try:
        got_fake = {w: run(fake_router.url, w) for w in ("smoke",)}
    finally:
        fake_router.close()
    results["pd-fake"] = got_fake
    ex = exactness(ref["smoke"], got_fake["smoke"], args)
    n_same = sum(v["identical"] for v in ex["by_prompt_len"].values())
    verdict["pd-fake"] = {"exactness": ex, "identical_requests": n_same,
                          # Only completed requests count: a crash is not a divergence.
                          "diverged": 0 <= n_same < len(got_fake["smoke"]["requests"]),
                          "decode_log": decode_facts(fake.text(mark), fake.text())}
    fake.stop()
    v = verdict["pd-ours"]
    control = verdict["pd-wide"]["exactness"]
    v["within_tolerance"] = {
        w: x["violations"] == 0 or (verdict["pd-wide"]["errors"] == 0
                                    and x["max_abs_dlogprob"] <= control[w]["max_abs_dlogprob"])
        for w, x in v["exactness"].items()}
    ok = (v["errors"] == 0 and not v["decode_log"]["transfer_failed"]
          and all(v["within_tolerance"].values())
          and v["exactness"]["smoke"]["below_topk_identical"] is True
          and (not args.check or (v["check"] or {}).get("check_ok") is True)
          and verdict["pd-fake"]["diverged"])
    verdict["ok"] = ok
    return verdict


def decode_pdretract(node, prefill, ref, args, checked: bool,
                     bootstrap_port: int = BOOTSTRAP_PORT, router_port: int = 32100):
    """``pdretract`` through a router to ``prefill`` and the decode ``node``,
    then a probe: (the run, what it shows against ``ref``, the node's decode
    log from its start and since the run began, and its counters if ``checked``)."""
    router = Router(free_port(router_port), node.url, prefill.url, bootstrap_port=bootstrap_port)
    try:
        mark = node.mark()
        got = run(router.url, "pdretract")
        probe = probe_after(router.url)
        if checked:
            e2e.flush_counters(router.url)
            time.sleep(1.0)
    finally:
        router.close()
    facts = decode_facts(node.text(mark), node.text())
    stats = e2e.log_stats(node.log, 0) if checked else {}
    return got, {
        "exactness": exactness(ref, got, args), "errors": len(got["errors"]),
        "requests": len(got["requests"]),
        "finished": sum(1 for q in got["requests"]
                        if (q.get("finish_reason") or {}).get("type") == "length"),
        "decode_log": facts, "probe": probe, "pools_back": pools_back(facts),
        "check": e2e.check_verdict("ours", stats) if checked else None,
        "exact_checked": stats.get("exact_checked"), "exact_mismatch": stats.get("exact_mismatch"),
        "hisparse_misses": stats.get("hisparse_misses"),
        "waited_in_prealloc": bool(facts["max_prealloc_req"]),
    }


def part_retract(nodes, results, args):
    verdict = {}
    ref = results.get("colo-base", {}).get("pdretract")
    colo = nodes["colo-base"]
    if ref is None:
        ref = run(colo.url, "pdretract")
        results.setdefault("colo-base", {})["pdretract"] = ref
    colo.stop()
    for name in ("pd-retract", "pd-press"):
        node = nodes[name]
        checked = name == "pd-retract" and args.check
        got, v = decode_pdretract(node, nodes["prefill"], ref, args, checked)
        results[name], verdict[name] = {"pdretract": got}, v
        node.stop()
        facts, ex = v["decode_log"], v["exactness"]
        v["ok"] = (v["errors"] == 0 and v["finished"] == 8
                   and ex["violations"] == 0 and v["probe"]["ok"] and v["pools_back"] is True
                   and not facts["traceback"])
        if name == "pd-retract":
            v["ok"] = (v["ok"] and facts["retractions"] > 0
                       and (not checked or (v["check"] or {}).get("check_ok") is True))
    # pd-press: reported; it is expected to wait in the prealloc queue, not retract
    verdict["ok"] = verdict["pd-retract"]["ok"]
    return verdict


FAULT_DEVICE_TOKENS = 16384
FAULT_FLAGS = ["--max-total-tokens", str(FAULT_DEVICE_TOKENS), "--context-length", "40960"]


def _send_and_hang_up(url: str, ids: list[int], after_s: float) -> None:
    """POST a streaming /generate and close the connection after ``after_s``."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": 64, "temperature": 0}}).encode()
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /generate HTTP/1.0\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(after_s)


def part_faults(nodes, results, args):
    """Faults against a HiSparse decode of its own (pd-fault: --max-total-tokens
    16384, host pool 8x); after each, a request that must succeed."""
    node, prefill = nodes["pd-fault"], nodes["prefill"]
    verdict: dict = {}
    router = Router(free_port(32200), node.url, prefill.url)

    def next_ok(tag):
        r = probe_after(router.url)
        verdict[tag]["next_request_ok"] = r["ok"]
        return r["ok"]

    try:
        # 1. Abort while the transfers are in flight: 4 clients hang up 0.3 s in.
        mark = node.mark()
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda k: _send_and_hang_up(router.url, e2e.make_ids(12000, 70 + k), 0.3),
                        range(4)))
        time.sleep(5)
        verdict["abort_in_flight"] = {"decode_log": decode_facts(node.text(mark), node.text())}
        next_ok("abort_in_flight")
        # 2. A prompt longer than the decode's device pool: 0.5.13's capacity
        # check (disaggregation/decode.py:542) must answer 400, naming the sizes.
        body = {"input_ids": e2e.make_ids(FAULT_DEVICE_TOKENS + 3000, 78),
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        try:
            with Router._post(router.url + "/generate", body, timeout=120) as r:
                verdict["too_long"] = {"status": r.status, "body": r.read()[:300].decode()}
        except urllib.error.HTTPError as exc:
            verdict["too_long"] = {"status": exc.code, "body": exc.read()[:300].decode()}
        next_ok("too_long")
        # 3. The prefill killed (SIGKILL) while 8 transfers are queued or in flight.
        mark = node.mark()
        killer = threading.Timer(0.8, lambda: os.killpg(prefill.srv.proc.pid, 9))
        killer.start()

        def one(k):
            try:
                r = e2e.stream_generate(router.url, e2e.make_ids(12000, 90 + k), 32, timeout=240)
                return {"finish_reason": r.get("finish_reason"), "tokens": len(r["output_ids"] or [])}
            except Exception as exc:
                return {"error": repr(exc)[:200]}

        with ThreadPoolExecutor(8) as ex:
            outcomes = list(ex.map(one, range(8)))
        killer.join()
        prefill.stopped = True
        prefill.srv.log.close()
        time.sleep(3)
        verdict["prefill_killed"] = {"outcomes": outcomes,
                                     "decode_log": decode_facts(node.text(mark), node.text())}
        # A new prefill on the same bootstrap port, then the next request.
        fresh = Node("prefill2", "base", prefill_flags(args), args.logs, args.model, env=PD_ENV)
        if fresh.wait_ready():
            router.prefill_url = fresh.url
            nodes["prefill"] = fresh
            next_ok("prefill_killed")
        else:
            verdict["prefill_killed"]["next_request_ok"] = False
        verdict["final_pools"] = decode_facts(node.text())
        verdict["final_pools_back"] = pools_back(verdict["final_pools"])
    finally:
        router.close()
        node.stop()
    verdict["ok"] = (all(verdict.get(k, {}).get("next_request_ok") for k in
                         ("abort_in_flight", "too_long", "prefill_killed"))
                     and verdict["too_long"].get("status") == 400
                     and verdict["final_pools_back"] is True
                     and not verdict["final_pools"]["traceback"])
    return verdict


def part_capacity(nodes, results, args):
    verdict = {}
    for name, n_req in (("pd-base", 4), ("pd-cap", None)):
        node = nodes[name]
        router = Router(free_port(32300), node.url, nodes["prefill"].url)
        try:
            mark = node.mark()
            got = run(router.url, "pdbound", max_requests=n_req, max_new=args.bound_new)
        finally:
            router.close()
        got.update(e2e.decode_only(node.text(mark)))
        results[name] = {"pdbound": got}
        verdict[name] = {k: got.get(k) for k in ("decode_only_tok_s", "decode_only_running",
                                                  "decode_only_lines", "output_tok_s", "wall_s")}
        verdict[name]["errors"] = len(got["errors"])
        verdict[name]["decode_log"] = decode_facts(node.text(mark), node.text())
        node.stop()
    b, o = verdict["pd-base"]["decode_only_tok_s"], verdict["pd-cap"]["decode_only_tok_s"]
    verdict["ratio"] = o / b if b and o else None
    verdict["exactness_vs_pd_base"] = exactness(results["pd-base"]["pdbound"],
                                                results["pd-cap"]["pdbound"], args)
    verdict["ok"] = bool(verdict["ratio"] and verdict["ratio"] >= CAPACITY_TARGET
                         and not verdict["pd-cap"]["errors"])
    return verdict


def draftprobe_records(directory: Path) -> list[dict]:
    """Every line scripts/draftprobe wrote under ``directory`` (both sides' processes)."""
    return [json.loads(line) for f in sorted(Path(directory).glob("draftprobe_*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


# SGLang's /health requests (rid HEALTH_CHECK_RID_PREFIX...): each side
# generates one token on its own with the fake bootstrap room 0, so nothing is
# transferred and their digests are not a pair.
def draft_windows(records: list[dict]) -> dict:
    """Per request (bootstrap room): whether the decode's digest equals the
    prefill's; rooms that lack either side are counted apart, health checks
    are left out."""
    rooms: dict = {}
    health = 0
    for r in records:
        if str(r.get("rid", "")).startswith(HEALTH_CHECK_RID_PREFIX):
            health += 1
            continue
        rooms.setdefault(r["room"], {})[r["side"]] = r["sha256"]
    both = {room: v for room, v in rooms.items() if {"prefill", "decode"} <= set(v)}
    same = sum(v["prefill"] == v["decode"] for v in both.values())
    return {"requests": len(both), "equal": same, "differ": len(both) - same,
            "one_side_only": len(rooms) - len(both), "health_checks": health}


def part_v4draft(nodes, results, args):
    """DeepSeek-V4 + EAGLE on both PD sides: with our registration the
    decode's draft SWA window equals the prefill's for every request, in the
    stock pair (0.5.13 alone) it differs for every one, and the registered
    pair's outputs match a colocated V4 + EAGLE server (every token below
    index_topk; logprobs within --tol above it, reported)."""
    colo = nodes["v4-colo"]
    ref = run(colo.url, "smoke")
    colo.stop()
    results["v4-colo"] = {"smoke": ref}  # pd.json keeps the reference, as part v4hs does
    verdict = {}
    for pair, (dec, pre, port) in {
            "registered": ("v4-decode", "v4-prefill", BOOTSTRAP_PORT),
            "stock": ("v4-decode-stock", "v4-prefill-stock", V4_STOCK_BOOTSTRAP_PORT)}.items():
        router = Router(free_port(32400), nodes[dec].url, nodes[pre].url, bootstrap_port=port)
        try:
            got = run(router.url, "smoke")
        finally:
            router.close()
        time.sleep(1.0)  # the last decode record is written as its request leaves the queue
        results[f"v4draft-{pair}"] = got
        verdict[pair] = {"errors": len(got["errors"]), "exactness": exactness(ref, got, args),
                         "draft_window": draft_windows(draftprobe_records(Path(args.logs) / f"draftprobe-{pair}")),
                         "decode_log": decode_facts(nodes[dec].text())}
        nodes[dec].stop()
        nodes[pre].stop()
    reg, stock = verdict["registered"], verdict["stock"]
    verdict["ok"] = (reg["errors"] == 0 and stock["errors"] == 0
                     and reg["draft_window"]["requests"] == len(ref["requests"]) > 0
                     and reg["draft_window"]["differ"] == 0
                     and stock["draft_window"]["requests"] > 0 and stock["draft_window"]["equal"] == 0
                     and reg["exactness"]["below_topk_identical"] is True)
    return verdict


def part_v4hs(nodes, results, args):
    """DeepSeek-V4 with HiSparse on a PD decode node, retracting: outputs as
    the colocated V4's below index_topk, every request served, the check
    exact over C4 rows, retractions > 0 and the pools back after a probe."""
    colo = nodes["v4hs-colo"]
    ref = run(colo.url, "pdretract")
    colo.stop()
    got, v = decode_pdretract(nodes["v4hs-decode"], nodes["v4hs-prefill"], ref, args, True,
                              bootstrap_port=V4HS_BOOTSTRAP_PORT, router_port=32500)
    results["v4hs-colo"], results["v4hs-decode"] = {"pdretract": ref}, {"pdretract": got}
    facts, ex = v["decode_log"], v["exactness"]
    v["ok"] = (v["errors"] == 0 and v["finished"] == len(ref["requests"]) > 0
               and facts["retractions"] > 0 and not facts["traceback"]
               and not facts["transfer_failed"] and v["probe"]["ok"] and v["pools_back"] is True
               and (v["check"] or {}).get("check_ok") is True
               and ex["below_topk_identical"] is True)
    return v


def v4hs_specs(args) -> dict:
    """The three servers of part v4hs: name -> (config, flags, env, check)."""
    retract = {"SGLANG_TEST_RETRACT": "1",
               "SGLANG_TEST_RETRACT_INTERVAL": str(args.retract_interval)}
    return {
        "v4hs-prefill": ("base", prefill_flags(args, V4HS_BOOTSTRAP_PORT), {}, False),
        "v4hs-decode": ("ours", SHORT_FLAGS + decode_flags(args), retract, True),
        "v4hs-colo": ("base", SHORT_FLAGS, {}, False),
    }


def v4draft_specs(args) -> dict:
    """The five servers of part v4draft: name -> (config, flags, env)."""
    def probe(pair):
        path = os.pathsep.join([str(DRAFTPROBE_DIR)] + ([os.environ["PYTHONPATH"]]
                                                        if os.environ.get("PYTHONPATH") else []))
        return {"DRAFTPROBE_OUT": str(Path(args.logs) / f"draftprobe-{pair}"), "PYTHONPATH": path}

    ours, stock = probe("registered"), probe("stock")
    return {
        "v4-prefill": ("base", V4_MTP + prefill_flags(args), ours),
        "v4-decode": ("base", V4_MTP + SHORT_FLAGS + decode_flags(args), ours),
        "v4-colo": ("base", V4_MTP + SHORT_FLAGS, {}),
        "v4-prefill-stock": ("bare", V4_MTP + prefill_flags(args, V4_STOCK_BOOTSTRAP_PORT), stock),
        "v4-decode-stock": ("bare", V4_MTP + SHORT_FLAGS + decode_flags(args), stock),
    }


def prefill_flags(args, bootstrap_port=BOOTSTRAP_PORT):
    return ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
            args.backend, "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--max-total-tokens", "131072", "--context-length", "40960"]


def decode_flags(args, backend=None):
    return ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
            backend or args.backend]


def plan_nodes(args) -> dict:
    """The servers the chosen parts need (launched together)."""
    m, L = args.model, args.logs
    want = set()
    if args.parts & {"exact", "retract", "faults", "capacity"}:
        want.add("prefill")
    if args.parts & {"exact", "retract"}:
        want.add("colo-base")
    if "exact" in args.parts:
        want |= {"pd-ours", "pd-wide", "pd-fake"}
    if "retract" in args.parts:
        want |= {"pd-retract", "pd-press"}
    if "faults" in args.parts:
        want.add("pd-fault")
    if "capacity" in args.parts:
        want |= {"pd-base", "pd-cap"}
    sa = shlex.split(args.server_args)
    specs = {
        "prefill": ("base", prefill_flags(args), {}, None, False),
        "colo-base": ("base", SHORT_FLAGS, {}, None, False),
        "pd-ours": ("ours", SHORT_FLAGS + decode_flags(args), {}, None, args.check),
        "pd-wide": ("base", WIDE_FLAGS + decode_flags(args), {}, None, False),
        "pd-fake": ("ours", SHORT_FLAGS + decode_flags(args, "fake"), {}, None, False),
        "pd-retract": ("ours", SHORT_FLAGS + decode_flags(args),
                       {"SGLANG_TEST_RETRACT": "1",
                        "SGLANG_TEST_RETRACT_INTERVAL": str(args.retract_interval)}, None,
                       args.check),
        "pd-press": ("ours", ["--max-total-tokens", "20000"] + decode_flags(args), {},
                     HS_TIGHT, False),
        "pd-fault": ("ours", FAULT_FLAGS + decode_flags(args), {}, None, False),
        "pd-base": ("base", LONG_FLAGS + decode_flags(args), {}, None, False),
        "pd-cap": ("ours", LONG_FLAGS + decode_flags(args), {}, None, False),
    }
    nodes = {}
    for name in [n for n in specs if n in want]:  # prefill first
        cfg, flags, env, hs, check = specs[name]
        nodes[name] = Node(name, cfg, flags, L, m, hs_config=hs, check=check,
                           env={**PD_ENV, **env}, server_args=sa)
        if name == "prefill":
            time.sleep(args.stagger_s)  # its pools first: they are the largest
    if "v4draft" in args.parts:
        for name, (cfg, flags, env) in v4draft_specs(args).items():
            nodes[name] = Node(name, cfg, flags, L, args.v4_model, env={**PD_ENV, **env}, server_args=sa)
    if "v4hs" in args.parts:
        for name, (cfg, flags, env, check) in v4hs_specs(args).items():
            nodes[name] = Node(name, cfg, flags, L, args.v4_model, check=check,
                               env={**PD_ENV, **env}, server_args=sa)
    return nodes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("TINY_DSV32", ".gpu/tiny-dsv32"))
    ap.add_argument("--parts", default="exact,retract,faults,capacity",
                    help=f"any of {', '.join(ESTIMATE_S)} (v4draft: DeepSeek-V4 + EAGLE; v4hs: DeepSeek-V4 "
                         "with HiSparse on the decode; neither in the default)")
    ap.add_argument("--v4-model", default=str(V4_MODEL), help="parts v4draft's and v4hs' DeepSeek-V4 model")
    ap.add_argument("--backend", default="mooncake_tcp",
                    help="--disaggregation-transfer-backend of prefill and decode")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="pd-ours with SGLANG_HISPARSE_CHECK=1 (default on)")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("GF_PD_BUDGET_S", 3600)))
    ap.add_argument("--retract-interval", type=int, default=100)
    ap.add_argument("--bound-new", type=int, default=2048)
    ap.add_argument("--stagger-s", type=float, default=5.0)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pd.json"))
    ap.add_argument("--logs", default=os.path.join(os.environ.get("OUT", "."), "pd"))
    args = ap.parse_args()
    t0 = time.time()
    args.parts = set(args.parts.split(","))
    bad = args.parts - set(ESTIMATE_S)
    if bad:
        ap.error(f"--parts: unknown {sorted(bad)}; allowed: {', '.join(ESTIMATE_S)}")
    args.model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    e2e.exit_on_sigterm()
    report: dict = {"parts": {}, "env": {**PD_ENV, "model": args.model, "backend": args.backend}}
    results: dict = {}

    def save():
        report["servers"] = {n.name: {"ready_s": n.ready_s, "error": n.error, "log": n.log.name}
                             for n in _NODES}
        Path(args.out).write_text(json.dumps({**report, "runs": results}, indent=1))

    try:
        nodes = plan_nodes(args)
        with ThreadPoolExecutor(len(nodes)) as ex:
            list(ex.map(lambda n: n.wait_ready(), nodes.values()))
        save()
        if nodes.get("prefill") and nodes["prefill"].ready_s is None:
            print("prefill did not start: nothing to run", flush=True)
            return 1
        # faults last: it kills the prefill (and starts another).
        for part, fn in (("exact", part_exact), ("retract", part_retract),
                         ("capacity", part_capacity), ("v4draft", part_v4draft),
                         ("v4hs", part_v4hs),
                         ("faults", part_faults)):
            if part not in args.parts:
                continue
            left = args.budget_s - (time.time() - t0)
            need = [n for n in nodes.values() if n.name != "prefill" and n.ready_s is None
                    and n.name in PART_NODES[part]]
            if left < ESTIMATE_S[part]:
                report["parts"][part] = {"skipped": f"{left:.0f} s left, needs ~{ESTIMATE_S[part]} s"}
            elif need:
                report["parts"][part] = {"skipped": f"servers not up: {[n.name for n in need]}"}
            else:
                print(f"== part {part} ({left:.0f} s left)", flush=True)
                try:
                    report["parts"][part] = fn(nodes, results, args)
                except Exception as exc:
                    import traceback

                    traceback.print_exc()
                    report["parts"][part] = {"ok": False, "error": repr(exc)[:500]}
            for n in PART_NODES[part]:
                if n in nodes and not (n == "colo-base" and "retract" in args.parts
                                       and part == "exact"):
                    nodes[n].stop()
            save()
    finally:
        stop_all()
        save()
    print_summary(report)
    return 0 if all(p.get("ok") for p in report["parts"].values() if "skipped" not in p) else 1


PART_NODES = {"exact": ("colo-base", "pd-ours", "pd-wide", "pd-fake"),
              "retract": ("colo-base", "pd-retract", "pd-press"),
              "faults": ("pd-fault",), "capacity": ("pd-base", "pd-cap"),
              "v4draft": ("v4-colo", "v4-prefill", "v4-decode", "v4-prefill-stock", "v4-decode-stock"),
              "v4hs": ("v4hs-colo", "v4hs-prefill", "v4hs-decode")}


def print_summary(report: dict) -> None:
    print("\nPD summary (pd.json has everything)")
    for part, v in report["parts"].items():
        if "skipped" in v:
            print(f"pd {part}: SKIPPED ({v['skipped']})")
            continue
        print(f"pd {part}: {'OK' if v.get('ok') else 'FAIL'}" + (f" {v['error']}" if v.get("error") else ""))
        if part == "exact" and "pd-ours" in v:
            o = v["pd-ours"]
            for name, runs in (("pd-ours", o["exactness"]), ("pd-wide", v["pd-wide"]["exactness"])):
                for w, ex in runs.items():
                    within = o["within_tolerance"][w] if name == "pd-ours" else None
                    print(f"   {name} {w:<10} {ex['checked_steps']} steps checked, {ex['violations']} over "
                          f"tol, max {ex['max_abs_dlogprob']:.4f}, identical by prompt "
                          + ", ".join(f"{k}:{d['identical']}/{d['n']}" for k, d in ex["by_prompt_len"].items())
                          + ("" if within is None else f" -> {'within' if within else 'OUTSIDE'} tolerance"))
            for w, ex in o["vs_pd_wide"].items():
                print(f"   pd-ours vs pd-wide {w:<10} {ex['checked_steps']} steps, {ex['violations']} over tol, "
                      f"max {ex['max_abs_dlogprob']:.4f}")
            print(f"   pd-ours check {o['exact_checked']} checked, {o['exact_mismatch']} mismatch "
                  f"({(o['check'] or {}).get('verdict')}), host misses {o['hisparse_misses']}, "
                  f"transfer failed {o['decode_log']['transfer_failed']}, router {o['router']}")
            f = v["pd-fake"]
            print(f"   pd-fake identical requests {f['identical_requests']} -> "
                  f"{'diverged' if f['diverged'] else 'DID NOT DIVERGE'}")
        if part == "v4draft" and "registered" in v:
            for pair in ("registered", "stock"):
                x, ex = v[pair], v[pair]["exactness"]
                w = x["draft_window"]
                print(f"   {pair}: draft SWA window equal {w['equal']}/{w['requests']} requests "
                      f"(one side only: {w['one_side_only']}), {x['errors']} errors; vs colocated: "
                      f"{ex['checked_steps']} steps, {ex['violations']} over tol, max "
                      f"{ex['max_abs_dlogprob']:.4f}, below index_topk identical {ex['below_topk_identical']}")
        if part == "v4hs" and "decode_log" in v:
            d, ex = v["decode_log"], v["exactness"]
            print(f"   v4hs-decode: {v['finished']}/{v['requests']} finished, {v['errors']} errors, "
                  f"retracted {d['retractions']} in {d['retraction_events']} events, probe "
                  f"{v['probe']['ok']}, pools back {v['pools_back']}, tracebacks {d['traceback']}; "
                  f"check {v['exact_checked']} C4 rows, {v['exact_mismatch']} mismatch "
                  f"({(v['check'] or {}).get('verdict')}), host misses {v['hisparse_misses']}; "
                  f"vs colocated: {ex['checked_steps']} steps, {ex['violations']} over tol, max "
                  f"{ex['max_abs_dlogprob']:.4f}, below index_topk identical {ex['below_topk_identical']}")
        if part == "retract":
            for name in ("pd-retract", "pd-press"):
                x = v.get(name)
                if x:
                    d = x["decode_log"]
                    print(f"   {name}: {x['finished']}/8 finished, {x['errors']} errors, "
                          f"retracted {d['retractions']} in {d['retraction_events']} events "
                          f"(max #retracted-req {d['max_retracted_req']}), oom aborts {d['oom_aborts']}, "
                          f"violations {x['exactness']['violations']}, probe {x['probe']['ok']}, "
                          f"#cpu token at end {d['last_cpu_token']} -> pools back {x['pools_back']}, "
                          f"max #prealloc-req {d['max_prealloc_req']}, tracebacks {d['traceback']}")
                    if x.get("check"):
                        print(f"   {name} check {x['exact_checked']} checked, "
                              f"{x['exact_mismatch']} mismatch ({x['check'].get('verdict')})")
                    if name == "pd-press":
                        print(f"   pd-press (expected: waits in the prealloc queue, no retraction "
                              f"required): waited {x['waited_in_prealloc']}, ok {x['ok']}")
        if part == "faults":
            for k in ("abort_in_flight", "too_long", "prefill_killed"):
                if k in v:
                    x = {kk: vv for kk, vv in v[k].items() if kk != "decode_log"}
                    print(f"   {k}: {x} transfer failed "
                          f"{(v[k].get('decode_log') or {}).get('transfer_failed')}")
            if "final_pools" in v:
                print(f"   final #cpu token {v['final_pools']['last_cpu_token']}, pools back "
                      f"{v.get('final_pools_back')}")
        if part == "capacity" and "pd-base" in v:
            b, o = v["pd-base"], v["pd-cap"]
            print(f"   decode-only tok/s: pd-base {b['decode_only_tok_s']} @{b['decode_only_running']}, "
                  f"pd-ours {o['decode_only_tok_s']} @{o['decode_only_running']} -> "
                  f"x{(v['ratio'] or 0):.2f} (target >= {CAPACITY_TARGET}x)")


if __name__ == "__main__":
    sys.exit(main())
