"""HiSparse counters in the decode log line and as Prometheus counters."""

from prometheus_client import CollectorRegistry

from sglang_hisparse.adapter import metrics

STATS = {
    "hits": 300, "misses": 100, "host_bytes_read": 100 * 1152,
    "host_bytes_written": 4 << 20, "hot_buffer_occupancy": 0.5, "staging_reqs": 1,
    "resident_reqs": 2, "demotions": 3, "parked_reqs": 4,
    "joins": 8, "join_wait_s": 0.2, "join_wait_max_s": 0.0625,
}


class _Coordinator:
    """Ours (the hook reads only its counters)."""

    def get_hisparse_stats(self):
        return dict(STATS)


def pool_stats(is_hisparse):
    """A fresh 0.5.13 PoolStats as SchedulerPoolStatsObserver hands it to the
    decode log line (the HiSparse fields as _get_hisparse_token_info sets them)."""
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    stats = PoolStats(full_num_used=30, full_token_usage=0.25, full_available_size=90,
                      full_evictable_size=0)
    if is_hisparse:
        stats.is_hisparse = True
        stats.hisparse_device_tokens, stats.hisparse_device_token_usage = 10, 0.125
        stats.hisparse_host_tokens, stats.hisparse_host_token_usage = 20, 0.5
    return stats


def test_decode_log_line_gets_the_counters():
    coord = _Coordinator()
    metrics.register_coordinator(coord)
    stats = pool_stats(True)
    sglang_parts = stats.get_decode_usage_msg_parts()  # 0.5.13's own parts
    parts = metrics.decode_usage_msg_parts(sglang_parts, stats)
    assert parts[: len(sglang_parts)] == sglang_parts
    line = ", ".join(parts)
    assert line.startswith("#gpu token: 10, gpu token usage: 0.12, #cpu token: 20, "
                           "cpu token usage: 0.50, hisparse hit rate: 0.750, #hisparse miss: 100")
    assert "host written: 4.0 MiB" in line
    assert "#hisparse resident: 2, #hisparse demoted: 3" in line
    # 0.2 s over 8 joins: 25 ms each on average, the longest 62.5 ms
    assert "#hisparse parked: 4, join wait mean/max: 25.0/62.5 ms" in line
    none_yet = metrics.format_stats(dict(STATS, joins=0, join_wait_s=0.0, join_wait_max_s=0.0))
    assert "join wait mean/max: 0.0/0.0 ms" in none_yet


def test_no_coordinator_or_not_hisparse_leaves_the_line():
    import gc

    coord = _Coordinator()
    metrics.register_coordinator(coord)
    plain = pool_stats(False)
    assert metrics.decode_usage_msg_parts(plain.get_decode_usage_msg_parts(), plain) is None
    del coord  # the coordinator is held weakly: gone with the model runner
    gc.collect()
    assert metrics.current_coordinator() is None
    hisparse = pool_stats(True)
    assert metrics.decode_usage_msg_parts(hisparse.get_decode_usage_msg_parts(), hisparse) is None


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
    assert registry.get_sample_value("sglang:hisparse_joins_total") == 8
    assert registry.get_sample_value("sglang:hisparse_join_wait_seconds_total") == 0.2
