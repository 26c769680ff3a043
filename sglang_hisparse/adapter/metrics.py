"""HiSparse counters where SGLang users look: the decode log line and Prometheus.

The coordinator keeps hit/miss counts on the device. They are read only
when SGLang prints a decode log line (every ``--decode-log-interval``
steps), through an asynchronous copy, so they trail by one line and nothing
waits on the GPU: an AFTER hook on
``PoolStats.get_decode_usage_msg_parts`` appends them to the line, and, with
``--enable-metrics``, the same reading advances Prometheus counters.
"""

from __future__ import annotations

import weakref

_coordinator_ref = None
_prometheus = None  # name -> prometheus_client metric, built on first use
_last: dict[str, float] = {}

# counter name -> (stats key, help); byte counters are cumulative too.
_COUNTERS = {
    "sglang:hisparse_topk_hits_total": ("hits", "Selected tokens found in the GPU hot buffer"),
    "sglang:hisparse_topk_misses_total": ("misses", "Selected tokens copied from host"),
    "sglang:hisparse_host_read_bytes_total": ("host_bytes_read", "Bytes copied host -> GPU"),
    "sglang:hisparse_host_written_bytes_total": ("host_bytes_written", "Bytes copied GPU -> host"),
    "sglang:hisparse_demotions_total": ("demotions", "Resident requests moved to a hot buffer"),
    "sglang:hisparse_joins_total": ("joins", "Requests that joined the decode batch after prefill"),
    "sglang:hisparse_join_wait_seconds_total": (
        "join_wait_s", "Seconds requests waited between prefill end and joining the decode batch"),
}
_GAUGES = {
    "sglang:hisparse_hot_buffer_occupancy": (
        "hot_buffer_occupancy", "Allocated share of the running requests' hot buffers"),
    "sglang:hisparse_staging_reqs": ("staging_reqs", "Requests copying their prefill to host"),
    "sglang:hisparse_resident_reqs": ("resident_reqs", "Requests with their whole KV on the GPU"),
    "sglang:hisparse_parked_reqs": ("parked_reqs", "Staged requests waiting on host for rows"),
}


def register_coordinator(coordinator) -> None:
    global _coordinator_ref
    _coordinator_ref = weakref.ref(coordinator)


def current_coordinator():
    return _coordinator_ref() if _coordinator_ref is not None else None


def format_stats(stats: dict) -> list[str]:
    seen = stats["hits"] + stats["misses"]
    return [
        f"hisparse hit rate: {stats['hits'] / seen if seen else 0.0:.3f}",
        f"#hisparse miss: {stats['misses']}",
        f"host read: {stats['host_bytes_read'] / 2**20:.1f} MiB",
        f"host written: {stats['host_bytes_written'] / 2**20:.1f} MiB",
        f"hot buffer occupancy: {stats['hot_buffer_occupancy']:.2f}",
        f"#hisparse resident: {stats['resident_reqs']}",
        f"#hisparse demoted: {stats['demotions']}",
        f"#hisparse parked: {stats['parked_reqs']}",
        _join_wait(stats),
    ] + ([f"#hisparse drift: {stats['accounting_drifts']}"] if stats.get("accounting_drifts") else []) + (
        [f"#exact checked: {stats['exact_checked']}", f"#exact mismatch: {stats['exact_mismatches']}"]
        if "exact_checked" in stats else [])


def _join_wait(stats: dict) -> str:
    """Mean and longest wait from a request's prefill end (its first token) to
    its joining the decode batch, over the server's life: what staging,
    host pages and parking add to a request's first inter-token gap."""
    joins = stats["joins"]
    mean = 1000 * stats["join_wait_s"] / joins if joins else 0.0
    return f"join wait mean/max: {mean:.1f}/{1000 * stats['join_wait_max_s']:.1f} ms"


def _metrics_enabled() -> bool:
    try:
        from sglang.srt.server_args import get_global_server_args

        return bool(get_global_server_args().enable_metrics)
    except Exception:
        return False


def publish(stats: dict, registry=None) -> None:
    """Advance the Prometheus counters to ``stats`` (creating them once)."""
    global _prometheus
    from prometheus_client import REGISTRY, Counter, Gauge

    if _prometheus is None:
        reg = registry or REGISTRY
        _prometheus = {name: Counter(name.removesuffix("_total"), text, registry=reg)
                       for name, (_, text) in _COUNTERS.items()}
        _prometheus.update({name: Gauge(name, text, registry=reg, multiprocess_mode="mostrecent")
                            for name, (_, text) in _GAUGES.items()})
    for name, (key, _) in _COUNTERS.items():
        delta = stats[key] - _last.get(key, 0)
        if delta > 0:
            _prometheus[name].inc(delta)
        _last[key] = stats[key]
    for name, (key, _) in _GAUGES.items():
        _prometheus[name].set(stats[key])


def decode_usage_msg_parts(parts, pool_stats, *args, **kwargs):
    """AFTER hook on ``PoolStats.get_decode_usage_msg_parts``."""
    coordinator = current_coordinator()
    if not getattr(pool_stats, "is_hisparse", False) or coordinator is None:
        return None
    stats = coordinator.get_hisparse_stats()
    if _metrics_enabled():
        publish(stats)
    return list(parts) + format_stats(stats)


def pool_stats_with_hisparse(observer, pool_stats):
    """REPLACE ``SchedulerPoolStatsObserver._get_hisparse_token_info``: the
    same fields as 0.5.13, set in place. Every branch of ``get_pool_stats``
    builds a fresh PoolStats just before this call, so nothing else holds it."""
    coordinator = observer.hisparse_coordinator
    if not observer.enable_hisparse or coordinator is None:
        return pool_stats
    h = coordinator.get_token_stats()
    pool_stats.is_hisparse = True
    pool_stats.hisparse_device_tokens = h.device_tokens
    pool_stats.hisparse_device_token_usage = h.device_token_usage
    pool_stats.hisparse_host_tokens = h.host_tokens
    pool_stats.hisparse_host_token_usage = h.host_token_usage
    return pool_stats
