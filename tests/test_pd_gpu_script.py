"""scripts/pd_gpu.py's pure parts on the CPU: the router does what 0.5.13's
mini load balancer does (the same body with a bootstrap room to prefill and
decode at once, the decode's answer back, the prefill's input logprobs
merged), the decode-log facts the PD verdicts read, and the server flags
each PD configuration gets. The two HTTP endpoints here stand in for the
servers' /generate (a GPU run talks to real ones)."""

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from test_gpu_scripts import SCRIPTS, _load

pd = _load("pd_gpu", SCRIPTS / "pd_gpu.py")


class Endpoint:
    """An HTTP /generate that records what it got (body, time, path) and
    answers as told."""

    def __init__(self, answer, delay_s=0.0, status=200):
        self.bodies, self.times, self.paths = [], [], []
        ep = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ep.bodies.append(body)
                ep.paths.append(self.path)
                ep.times.append(time.time())
                time.sleep(delay_s)
                self.send_response(status)
                self.end_headers()
                for line in answer(body):
                    self.wfile.write(line.encode() + b"\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def sse(obj):
    return "data: " + json.dumps(obj)


@pytest.fixture
def pair():
    prefill = Endpoint(lambda b: [sse({"meta_info": {"input_token_logprobs": [[None, 5], [-1.5, 6]]}}),
                                  "data: [DONE]"], delay_s=0.3)
    decode = Endpoint(lambda b: [sse({"output_ids": [9], "meta_info": {"input_token_logprobs": []}}),
                                 sse({"output_ids": [9, 10], "meta_info": {}}), "data: [DONE]"])
    router = pd.Router(pd.free_port(39000), decode.url, prefill.url, log=lambda s: None)
    yield prefill, decode, router
    router.close()
    prefill.close()
    decode.close()


def _stream(url, body):
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [json.loads(x[5:]) for x in (l.decode().strip() for l in r)
                if x.startswith("data:") and x != "data: [DONE]"]


def test_router_posts_both_at_once_with_one_room_and_returns_the_decodes_stream(pair):
    prefill, decode, router = pair
    chunks = _stream(router.url, {"input_ids": [5, 6], "stream": True, "return_logprob": True})
    (pb,), (db,) = prefill.bodies, decode.bodies
    assert pb == db and pb["bootstrap_host"] == "127.0.0.1"
    assert pb["bootstrap_port"] == pd.BOOTSTRAP_PORT and 0 <= pb["bootstrap_room"] < 2 ** 63
    # At the same time: the prefill answers 0.3 s late, the decode was not kept waiting for it.
    assert abs(prefill.times[0] - decode.times[0]) < 0.2
    assert [c["output_ids"] for c in chunks] == [[9], [9, 10]]
    # The prefill's input logprobs merged in front of the decode's (empty) ones.
    assert chunks[0]["meta_info"]["input_token_logprobs"] == [[None, 5], [-1.5, 6]]
    assert router.counts == {"requests": 1, "prefill_errors": 0, "decode_errors": 0}
    assert "room=" in router.lines[0] and "prefill=200" in router.lines[0]


def test_router_rooms_differ_and_a_decode_error_reaches_the_client():
    prefill = Endpoint(lambda b: ["{}"])
    decode = Endpoint(lambda b: ['{"error": "Request exceeds the maximum number of tokens"}'],
                      status=400)
    router = pd.Router(pd.free_port(39100), decode.url, prefill.url, log=lambda s: None)
    try:
        for _ in range(2):
            with pytest.raises(urllib.error.HTTPError) as exc:
                _stream(router.url, {"input_ids": [1]})
            assert exc.value.code == 400 and b"maximum number of tokens" in exc.value.read()
        assert prefill.bodies[0]["bootstrap_room"] != prefill.bodies[1]["bootstrap_room"]
        assert router.counts["decode_errors"] == 2
    finally:
        router.close()
        prefill.close()
        decode.close()


def test_fake_control_sends_sglangs_fake_bootstrap_host_and_no_prefill():
    # 0.5.13's decode crashes on bootstrap_host None (seen on the H200): the
    # fake control must send what SGLang's own PD warm-up sends.
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    decode = Endpoint(lambda b: [sse({"output_ids": [3]}), "data: [DONE]"])
    router = pd.Router(pd.free_port(39200), decode.url, None, log=lambda s: None)
    try:
        _stream(router.url, {"input_ids": [1], "stream": True})
        body = decode.bodies[0]
        assert body["bootstrap_host"] == FAKE_BOOTSTRAP_HOST
        assert 0 <= body["bootstrap_room"] < 2 ** 63 and "bootstrap_port" not in body
    finally:
        router.close()
        decode.close()


LOG = """\
[x] KV cache is forced as chunk cache for decode server
[x] Testing retraction. #retracted_reqs: 2, #new_tokens_gained: 0
[x] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 64, #new_token_ratio: 0.1 -> 0.2
[x] Decode batch, #running-req: 6, #gpu token: 100, gpu token usage: 0.1, #cpu token: 24000, cpu token usage: 0.5, pre-allocated usage: 0.00, #prealloc-req: 1, #transfer-req: 0, #retracted-req: 2, gen throughput (token/s): 100.0
[x] Decode batch, #running-req: 1, #gpu token: 100, gpu token usage: 0.1, #cpu token: 640, cpu token usage: 0.0, pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, gen throughput (token/s): 90.0
"""


def test_decode_facts_and_pools_back_read_the_last_decode_line():
    f = pd.decode_facts(LOG)
    assert f["retractions"] == 3 and f["retraction_events"] == 2 and f["max_retracted_req"] == 2
    assert f["last_cpu_token"] == 640 and f["last_retracted_req"] == 0 and f["chunk_cache_forced"]
    assert pd.pools_back(f) is True
    # One more page than the probe's own on host: a leak.
    leaked = pd.decode_facts(LOG.replace("#cpu token: 640", "#cpu token: 704"))
    assert pd.pools_back(leaked) is False
    stuck = pd.decode_facts(LOG.replace("#prealloc-req: 0", "#prealloc-req: 1"))
    assert pd.pools_back(stuck) is False
    assert pd.pools_back(pd.decode_facts("")) is None


def test_decode_facts_read_how_the_server_started_from_the_whole_log():
    # 0.5.13's own start-up lines (run 3 of 2026-12-02-third): they precede
    # any workload's mark, so the facts read them from the whole log.
    startup = (
        "[x] disaggregation transfer backend 'mooncake_tcp' -> mooncake with MC_FORCE_TCP=1 "
        "(TCP transport, no RDMA)\n"
        "[x] KV cache is forced as chunk cache for decode server\n"
        "I1202 transfer_engine_impl.cpp:250] MC_FORCE_TCP is set, using TCP transport only\n")
    after_mark = LOG.split("\n", 1)[1]
    f = pd.decode_facts(after_mark, startup + after_mark)
    assert f["tcp_transport"] and f["chunk_cache_forced"] and f["retractions"] == 3
    assert not pd.decode_facts(after_mark)["tcp_transport"]
    # a run on RDMA logs neither line
    rdma = pd.decode_facts(after_mark, "[x] KV cache is forced as chunk cache for decode server\n")
    assert not rdma["tcp_transport"] and rdma["chunk_cache_forced"]


@pytest.fixture
def launches(monkeypatch):
    """e2e.Server stood in: per launch (config, flags, options, the
    environment it saw, model), in launch order."""
    made = []

    class Srv:
        def __init__(self, model, port, config, extra, log, **opts):
            made.append((config, extra, opts, dict(pd.os.environ), model))
            self.url = f"http://127.0.0.1:{port}"

    monkeypatch.setattr(pd.e2e, "Server", Srv)
    monkeypatch.setattr(pd, "_NODES", [])
    return made


def test_each_pd_configuration_gets_its_flags(launches, tmp_path):
    made = launches
    args = type("A", (), {"model": "m", "logs": str(tmp_path), "backend": "mooncake_tcp",
                          "check": True, "retract_interval": 50, "server_args": "",
                          "stagger_s": 0, "parts": set(pd.ESTIMATE_S) - {"v4draft", "v4hs"}})()
    nodes = pd.plan_nodes(args)
    assert list(nodes)[0] == "prefill" and len(nodes) == 10
    by = {n: made[i] for i, n in enumerate(nodes)}
    flags = lambda n: " ".join(by[n][1])  # noqa: E731
    assert "--disaggregation-mode prefill" in flags("prefill") and by["prefill"][0] == "base"
    assert "--disaggregation-bootstrap-port 8998" in flags("prefill")
    assert "--disaggregation-transfer-backend fake" in flags("pd-fake") and by["pd-fake"][0] == "ours"
    assert by["pd-ours"][2]["check"] is True and by["pd-cap"][2]["check"] is False
    assert by["pd-retract"][2]["check"] is True  # where bytes differ after a resume
    assert by["pd-base"][0] == "base" and "--max-total-tokens 72000" in flags("pd-base")
    assert "--max-total-tokens 72000" in flags("pd-cap") and by["pd-cap"][0] == "ours"
    # the control for batch composition: no HiSparse, room for 16 x 16128 tokens
    assert by["pd-wide"][0] == "base" and "--max-total-tokens 300000" in flags("pd-wide")
    assert "--disaggregation-mode decode" in flags("pd-wide")
    assert by["pd-retract"][3]["SGLANG_TEST_RETRACT"] == "1"
    assert by["pd-retract"][3]["SGLANG_TEST_RETRACT_INTERVAL"] == "50"
    assert "SGLANG_TEST_RETRACT" not in pd.os.environ  # set only around that launch
    assert by["pd-press"][2]["hs_config"]["host_to_device_ratio"] == 1
    assert all(by[n][3]["SGLANG_HOST_IP"] == "127.0.0.1" for n in nodes)
    assert "colo-base" in nodes and "--disaggregation-mode" not in flags("colo-base")


def test_v4draft_runs_a_probed_pair_with_and_without_our_registration(launches, tmp_path):
    """Part v4draft: five DeepSeek-V4 + EAGLE servers, the registered pair
    (base: our plugin loaded) and the stock pair (every plugin but ours) on
    bootstrap ports of their own, each side probed into its pair's folder,
    and the colocated reference without PD or probe."""
    args = type("A", (), {"model": "m", "v4_model": "v4", "logs": str(tmp_path), "backend": "mooncake_tcp",
                          "check": True, "retract_interval": 50, "server_args": "", "stagger_s": 0,
                          "parts": {"v4draft"}})()
    nodes = pd.plan_nodes(args)
    assert list(nodes) == list(pd.PART_NODES["v4draft"][1:3]) + ["v4-colo", "v4-prefill-stock",
                                                                 "v4-decode-stock"]
    by = {n: launches[i] for i, n in enumerate(nodes)}
    flags = lambda n: " ".join(by[n][1])  # noqa: E731
    assert all(by[n][4] == "v4" and "--speculative-algorithm EAGLE" in flags(n)
               and "--speculative-eagle-topk 1" in flags(n) for n in nodes)
    assert by["v4-prefill"][0] == by["v4-decode"][0] == by["v4-colo"][0] == "base"
    assert by["v4-prefill-stock"][0] == by["v4-decode-stock"][0] == "bare"
    assert "--disaggregation-bootstrap-port 8998" in flags("v4-prefill")
    assert "--disaggregation-bootstrap-port 8999" in flags("v4-prefill-stock")
    for pair, names in (("registered", ("v4-prefill", "v4-decode")),
                        ("stock", ("v4-prefill-stock", "v4-decode-stock"))):
        for n in names:
            assert by[n][3]["DRAFTPROBE_OUT"] == str(tmp_path / f"draftprobe-{pair}")
            assert by[n][3]["PYTHONPATH"].split(pd.os.pathsep)[0] == str(pd.DRAFTPROBE_DIR)
    assert "DRAFTPROBE_OUT" not in by["v4-colo"][3] and "--disaggregation-mode" not in flags("v4-colo")
    assert "DRAFTPROBE_OUT" not in pd.os.environ  # set only around each launch


def test_v4hs_runs_a_hisparse_v4_decode_that_retracts_beside_a_plain_prefill(launches, tmp_path):
    """Part v4hs: a plain V4 prefill on a bootstrap port of its own, our V4
    decode with the check and 0.5.13's forced retraction, and a colocated V4
    reference; every one on the V4 model."""
    args = type("A", (), {"model": "m", "v4_model": "v4", "logs": str(tmp_path), "backend": "mooncake_tcp",
                          "check": False, "retract_interval": 30, "server_args": "", "stagger_s": 0,
                          "parts": {"v4hs"}})()
    nodes = pd.plan_nodes(args)
    assert set(nodes) == set(pd.PART_NODES["v4hs"])
    by = {n: launches[i] for i, n in enumerate(nodes)}
    flags = lambda n: " ".join(by[n][1])  # noqa: E731
    assert all(by[n][4] == "v4" for n in nodes)
    assert by["v4hs-prefill"][0] == by["v4hs-colo"][0] == "base" and by["v4hs-decode"][0] == "ours"
    assert "--disaggregation-mode prefill" in flags("v4hs-prefill")
    assert f"--disaggregation-bootstrap-port {pd.V4HS_BOOTSTRAP_PORT}" in flags("v4hs-prefill")
    assert pd.V4HS_BOOTSTRAP_PORT not in (pd.BOOTSTRAP_PORT, pd.V4_STOCK_BOOTSTRAP_PORT)
    assert "--disaggregation-mode decode" in flags("v4hs-decode")
    assert by["v4hs-decode"][2]["check"] is True  # whatever --check says: the proof is the check
    assert by["v4hs-decode"][3]["SGLANG_TEST_RETRACT"] == "1"
    assert by["v4hs-decode"][3]["SGLANG_TEST_RETRACT_INTERVAL"] == "30"
    assert "SGLANG_TEST_RETRACT" not in by["v4hs-prefill"][3]
    assert "--disaggregation-mode" not in flags("v4hs-colo")


def test_draft_windows_pair_the_sides_by_room(tmp_path):
    """Rooms pair the sides; each side's /health request (room 0, nothing
    transferred: 2026-12-06-s2 counted it as a 6th request that differed)
    is left out."""
    health = [{"side": side, "room": 0, "rid": f"HEALTH_CHECK_{k}", "sha256": side}
              for k, side in enumerate(("prefill", "decode", "prefill"))]
    lines = [{"side": "prefill", "room": 1, "sha256": "a"}, {"side": "decode", "room": 1, "sha256": "a"},
             {"side": "prefill", "room": 2, "sha256": "b"}, {"side": "decode", "room": 2, "sha256": "c"},
             {"side": "prefill", "room": 3, "sha256": "d"}]
    (tmp_path / "draftprobe_1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[::2] + health))
    (tmp_path / "draftprobe_2.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[1::2]))
    assert pd.draft_windows(pd.draftprobe_records(tmp_path)) == {
        "requests": 2, "equal": 1, "differ": 1, "one_side_only": 1, "health_checks": 3}


def test_below_topk_judges_the_tokens_decoded_before_the_context_reaches_it():
    """v4hs (2026-12-06-s2): 2000-token prompts x 1200 outputs; every
    request's first differing token came at step 54-111, past the 48 decoded
    below index_topk, each at a top-2 gap of at most 0.031. Identical over
    those 48 passes; a difference at step 47 fails."""
    def req(ids):
        return {"prompt_len": 2000, "output_ids": ids, "logprobs": [-8.0] * len(ids),
                "top2": [[-8.0, -8.1]] * len(ids)}
    args = SimpleNamespace(margin=0.05, tol=0.05)
    assert pd.within_topk_tokens(2000) == 48 and pd.within_topk_tokens(9000) == 0
    ref = {"requests": [req(list(range(120)))]}
    late = {"requests": [req(list(range(54)) + [7] * 66)]}
    early = {"requests": [req(list(range(47)) + [7] * 73)]}
    got = pd.exactness(ref, late, args)
    assert got["below_topk_identical"] is True
    assert got["by_prompt_len"]["2000"] == {"n": 1, "identical": 0, "identical_within_topk": 1,
                                            "first_token_equal": 1}
    assert pd.exactness(ref, early, args)["below_topk_identical"] is False


@pytest.mark.parametrize("config", ["stock", "bare"])
def test_stock_keeps_the_diagnostic_plugins_on_the_servers_path(monkeypatch, config):
    """Configs stock and bare whitelist every plugin but ours, including one
    that only the server's PYTHONPATH holds (scripts/draftprobe); bare runs
    without HiSparse, stock with 0.5.13's own."""
    monkeypatch.setenv("PYTHONPATH", str(pd.DRAFTPROBE_DIR))
    cmd, env = pd.e2e.server_cmd("tests/data/tiny-dsv32", 30010, config, [])
    plugins = env["SGLANG_PLUGINS"].split(",")
    assert "hisparse_draftprobe" in plugins and "sglang_hisparse" not in plugins
    assert ("--enable-hisparse" in cmd) is (config == "stock")


# 0.5.13's start-up lines without openai_harmony (every server of the third GPU session)
BENIGN_STARTUP = """\
[x] Can not initialize OpenAIServingResponses, error: Traceback (most recent call last):
  File "/tmp/site/sglang/srt/entrypoints/http_server.py", line 372, in lifespan
    from sglang.srt.entrypoints.openai.serving_responses import (
ModuleNotFoundError: No module named 'openai_harmony'

[x] The server is fired up and ready to roll!
"""


def test_decode_facts_count_tracebacks_other_than_the_benign_start_up_one():
    assert pd.decode_facts(BENIGN_STARTUP + LOG)["traceback"] == 0
    crash = BENIGN_STARTUP + LOG + "Traceback (most recent call last):\n  File x\nRuntimeError: y\n"
    assert pd.decode_facts(crash)["traceback"] == 1
    assert pd.e2e.count_tracebacks(crash) == {"benign": 1, "other": 1}
    assert pd.decode_facts(LOG)["max_prealloc_req"] == 1


class _LogNode:
    """The script's Node as part_retract reads it: a URL, a log text, stop()."""

    def __init__(self, name, text):
        self.name, self.url, self.log, self._text, self.stopped = name, f"http://{name}", name, text, False

    def mark(self):
        return 0

    def text(self, since=0):
        return self._text

    def stop(self):
        self.stopped = True


def _part_retract(monkeypatch, retract_log, press_log, check=True, checked=(100, 0)):
    finished = {"errors": [], "requests": [{"finish_reason": {"type": "length"}}] * 8}
    monkeypatch.setattr(pd, "run", lambda url, w: finished)
    monkeypatch.setattr(pd, "probe_after", lambda url: {"ok": True})
    monkeypatch.setattr(pd, "exactness", lambda ref, got, args: {"violations": 0})
    monkeypatch.setattr(pd, "Router", lambda *a, **kw: type("R", (), {"url": "r", "close": lambda s: None})())
    monkeypatch.setattr(pd.e2e, "flush_counters", lambda url: None)
    monkeypatch.setattr(pd.time, "sleep", lambda s: None)
    monkeypatch.setattr(pd.e2e, "log_stats", lambda log, start: {
        "exact_checked": checked[0], "exact_mismatch": checked[1]})
    nodes = {"colo-base": _LogNode("colo-base", ""), "prefill": _LogNode("prefill", ""),
             "pd-retract": _LogNode("pd-retract", retract_log),
             "pd-press": _LogNode("pd-press", press_log)}
    args = type("A", (), {"check": check})()
    return pd.part_retract(nodes, {"colo-base": {"pdretract": finished}}, args)


def test_retract_verdict_pd_press_waits_in_the_prealloc_queue_without_retracting(monkeypatch):
    no_retraction = BENIGN_STARTUP + "\n".join(
        line for line in LOG.splitlines() if "etract" not in line.split("Decode batch")[0])
    v = _part_retract(monkeypatch, BENIGN_STARTUP + LOG, no_retraction)
    assert v["pd-press"]["decode_log"]["retractions"] == 0
    assert v["pd-press"]["waited_in_prealloc"] and v["pd-press"]["ok"]
    assert v["pd-retract"]["check"]["check_ok"] is True and v["pd-retract"]["ok"] and v["ok"]
    # pd-retract must retract, and its check must be exact
    assert not _part_retract(monkeypatch, no_retraction, no_retraction)["ok"]
    assert not _part_retract(monkeypatch, LOG, LOG, checked=(100, 3))["ok"]
    assert not _part_retract(monkeypatch, LOG, LOG, checked=(0, 0))["ok"]  # never checked
    assert _part_retract(monkeypatch, LOG, LOG, check=False)["pd-retract"]["check"] is None
    # a real traceback fails either
    crash = LOG + "Traceback (most recent call last):\nRuntimeError: y\n"
    v = _part_retract(monkeypatch, LOG, crash)
    assert v["ok"] and not v["pd-press"]["ok"]


def test_v4hs_verdict_needs_retractions_an_exact_check_and_the_reference_below_topk(monkeypatch):
    """part_v4hs through the same stand-ins as part_retract: our V4 decode's
    log must show retractions, its check 0 mismatches, every request finish."""
    def v4hs(log, checked=(100, 0), below_topk=True):
        _part_retract(monkeypatch, "", "", checked=checked)  # installs the stand-ins
        monkeypatch.setattr(pd, "exactness", lambda ref, got, args: {
            "violations": 0, "below_topk_identical": below_topk})
        nodes = {n: _LogNode(n, log if n == "v4hs-decode" else "")
                 for n in ("v4hs-colo", "v4hs-prefill", "v4hs-decode")}
        return pd.part_v4hs(nodes, {}, type("A", (), {"check": True})())

    no_retraction = BENIGN_STARTUP + "\n".join(
        line for line in LOG.splitlines() if "etract" not in line.split("Decode batch")[0])
    v = v4hs(BENIGN_STARTUP + LOG)
    assert v["ok"] and v["decode_log"]["retractions"] > 0 and v["finished"] == 8
    assert not v4hs(no_retraction)["ok"]
    assert not v4hs(BENIGN_STARTUP + LOG, checked=(100, 3))["ok"]
    assert not v4hs(BENIGN_STARTUP + LOG, below_topk=False)["ok"]


def _part_exact(monkeypatch, ours_capacity_max, wide_capacity_max):
    """part_exact with servers replaced: every workload of a node answers
    with a marker, and exactness() reads the figures planted for a pair."""
    monkeypatch.setattr(pd, "run", lambda url, w: {"node": url, "workload": w, "errors": [],
                                                   "requests": [{}]})
    monkeypatch.setattr(pd, "Router", lambda port, decode, prefill: type(
        "R", (), {"url": decode, "counts": {}, "close": lambda s: None})())
    monkeypatch.setattr(pd.e2e, "flush_counters", lambda url: None)
    monkeypatch.setattr(pd.time, "sleep", lambda s: None)
    monkeypatch.setattr(pd.e2e, "log_stats", lambda log, start: {
        "exact_checked": 100, "exact_mismatch": 0, "hisparse_misses": 5})
    monkeypatch.setattr(pd.e2e, "check_verdict", lambda cfg, stats: {"check_ok": True})
    planted = {"http://pd-ours": ours_capacity_max, "http://pd-wide": wide_capacity_max}

    def exactness(ref, got, args):
        if got["node"] == "http://pd-fake":
            return {"violations": 3, "max_abs_dlogprob": 1.0,
                    "by_prompt_len": {"600": {"n": 1, "identical": 0}}}
        worst = planted.get(got["node"], 0.0) if got["workload"] == "capacity" else 0.02
        if ref["node"] != "http://colo-base":
            worst = 0.03  # pd-ours vs pd-wide: reported, not judged
        return {"violations": int(worst > 0.05), "max_abs_dlogprob": worst,
                "by_prompt_len": {"600": {"n": 1, "identical": 1}}, "below_topk_identical": True}

    monkeypatch.setattr(pd, "exactness", exactness)
    nodes = {n: _LogNode(n, "") for n in ("colo-base", "prefill", "pd-ours", "pd-wide", "pd-fake")}
    args = type("A", (), {"check": True, "parts": {"exact"}})()
    return pd.part_exact(nodes, {}, args)


def test_exact_verdict_judges_a_step_over_tol_against_the_wide_control(monkeypatch):
    # 0.0626 on capacity (run 1 of 2026-12-03) passes only where the control
    # without HiSparse, running the same batch sizes, is at least as far off.
    v = _part_exact(monkeypatch, 0.0626, 0.0626)
    assert v["ok"] and v["pd-ours"]["within_tolerance"]["capacity"]
    assert v["pd-ours"]["vs_pd_wide"]["capacity"]["max_abs_dlogprob"] == 0.03
    v = _part_exact(monkeypatch, 0.0626, 0.0313)
    assert not v["ok"] and not v["pd-ours"]["within_tolerance"]["capacity"]
    assert v["pd-ours"]["within_tolerance"]["smoke"]
    assert _part_exact(monkeypatch, 0.04, 0.0)["ok"]  # within --tol needs no control


def test_stop_all_tells_every_server_before_waiting_for_any(monkeypatch, tmp_path):
    """A PD run holds up to ten servers; stopped one after the other each
    may take 30 s, longer than a cut-off stage's grace. stop_all signals
    them all first, and a node stopped earlier is left alone."""
    events = []

    class Recorder:  # e2e_gpu.Server's stop interface
        def __init__(self, model, port, config, *a, **kw):
            self.config, self.url = config, f"http://127.0.0.1:{port}"

        def terminate(self):
            events.append(("terminate", self.config))

        def stop(self):
            events.append(("stop", self.config))

    monkeypatch.setattr(pd.e2e, "Server", Recorder)
    monkeypatch.setattr(pd, "_NODES", [])
    nodes = [pd.Node(name, name, [], tmp_path, "/m") for name in ("a", "b", "c")]
    nodes[1].stop()
    events.clear()
    pd.stop_all()
    assert events == [("terminate", "a"), ("terminate", "c"), ("stop", "a"), ("stop", "c")]
