"""HiSparse counters in the decode log line and as Prometheus counters."""

from prometheus_client import CollectorRegistry

from sglang_hisparse import metrics

STATS = {
    "hits": 300, "misses": 100, "host_bytes_read": 100 * 1152,
    "host_bytes_written": 4 << 20, "hot_buffer_occupancy": 0.5, "staging_reqs": 1,
    "resident_reqs": 2, "demotions": 3, "parked_reqs": 4,
}


class _Coordinator:
    def get_hisparse_stats(self):
        return dict(STATS)


class _PoolStats:
    is_hisparse = True


def test_decode_log_line_gets_the_counters():
    coord = _Coordinator()
    metrics.register_coordinator(coord)
    parts = metrics.decode_usage_msg_parts(["#gpu token: 10"], _PoolStats())
    line = ", ".join(parts)
    assert line.startswith("#gpu token: 10, hisparse hit rate: 0.750, #hisparse miss: 100")
    assert "host written: 4.0 MiB" in line
    assert "#hisparse resident: 2, #hisparse demoted: 3" in line


def test_no_coordinator_or_not_hisparse_leaves_the_line():
    metrics.register_coordinator(_Coordinator())
    assert metrics.decode_usage_msg_parts(["x"], object()) is None


def test_prometheus_counters_advance_by_deltas(monkeypatch):
    registry = CollectorRegistry()
    monkeypatch.setattr(metrics, "_prometheus", None)
    monkeypatch.setattr(metrics, "_last", {})
    metrics.publish(dict(STATS), registry=registry)
    later = dict(STATS, hits=500, misses=150)
    metrics.publish(later, registry=registry)
    assert registry.get_sample_value("sglang:hisparse_topk_hits_total") == 500
    assert registry.get_sample_value("sglang:hisparse_topk_misses_total") == 150
    assert registry.get_sample_value("sglang:hisparse_hot_buffer_occupancy") == 0.5
    assert registry.get_sample_value("sglang:hisparse_resident_reqs") == 2
    assert registry.get_sample_value("sglang:hisparse_parked_reqs") == 4
    assert registry.get_sample_value("sglang:hisparse_demotions_total") == 3
