"""The server's Prometheus metrics (``prometheus_client``), one registry per app: queue depth
(all replicas, and each replica's), busy slots, KV cache positions and KV pool blocks in use
read from the ``Server`` at each scrape; generated tokens and requests counted; time to first
token, inter-token latency and request latency as histograms (seconds)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _CoreCounters:
    """Counters the serving core keeps (every token it generated, whoever listened)."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        stats = self.server.stats
        yield CounterMetricFamily("triax_generated_tokens", "tokens generated",
                                  value=stats["generated_tokens"])
        yield CounterMetricFamily("triax_preemptions", "running sequences preempted (by "
                                  "recompute) for want of KV blocks",
                                  value=stats["preemptions"])
        yield CounterMetricFamily("triax_prefix_cache_queries", "prompt tokens looked up in "
                                  "the prefix cache", value=stats["prefix_queries"])
        yield CounterMetricFamily("triax_prefix_cache_hits", "prompt tokens found in the "
                                  "prefix cache (not prefilled)", value=stats["prefix_hits"])
        spec = self.server.speculative_stats
        yield CounterMetricFamily("triax_speculative_proposed_tokens", "tokens proposed to "
                                  "the target (speculative decoding)", value=spec["proposed"])
        yield CounterMetricFamily("triax_speculative_accepted_tokens", "proposed tokens the "
                                  "target kept", value=spec["accepted"])
        yield GaugeMetricFamily("triax_speculative_acceptance_rate", "accepted / proposed "
                                "tokens so far (0 before any)",
                                value=spec["accepted"] / max(spec["proposed"], 1))
        yield GaugeMetricFamily("triax_speculative_mean_accepted_length", "tokens a row emits "
                                "per verify step: 1 + accepted proposals per step (0 before "
                                "any)", value=(spec["rounds"] + spec["accepted"])
                                / max(spec["rounds"], 1))
        pool = GaugeMetricFamily("triax_kv_pool_bytes", "KV pool bytes per device (k, v and "
                                 "an int8 pool's scales), labelled with what it stores and "
                                 "the served weights' dtype", labels=["kv_dtype", "dtype"])
        pool.add_metric([self.server.kv_dtype, self.server.dtype], self.server.kv_pool_bytes)
        yield pool
        weights = GaugeMetricFamily("triax_weight_bytes", "served weight bytes per device as "
                                    "placed (the largest replica's), labelled with their "
                                    "dtype and --quantize", labels=["dtype", "quantize"])
        weights.add_metric([self.server.dtype, self.server.quantize], self.server.weight_bytes)
        yield weights

_LATENCY = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, server):
        self.registry = r = CollectorRegistry()
        Gauge("triax_queue_depth", "requests waiting for a decode slot, all replicas",
              registry=r).set_function(lambda: server.queued)
        depth = Gauge("triax_replica_queue_depth", "requests waiting in a replica's queue",
                      ["replica"], registry=r)
        for i in range(len(server.slots_per_replica)):
            depth.labels(replica=str(i)).set_function(
                lambda i=i: server.queued_per_replica[i])
        Gauge("triax_busy_slots", "decode slots holding a request",
              registry=r).set_function(lambda: server.total_slots - server.free_slots)
        Gauge("triax_total_slots", "decode slots over all replicas",
              registry=r).set_function(lambda: server.total_slots)
        Gauge("triax_kv_positions_in_use", "KV cache positions held by live requests, all "
              "replicas", registry=r).set_function(lambda: server.kv_positions_in_use)
        Gauge("triax_kv_blocks_in_use", "KV pool blocks held by live requests, all replicas",
              registry=r).set_function(lambda: server.kv_blocks_in_use)
        Gauge("triax_kv_blocks_total", "KV pool blocks over all replicas",
              registry=r).set_function(lambda: server.kv_blocks_total)
        r.register(_CoreCounters(server))
        self.requests = Counter("triax_requests", "requests finished",
                                ["endpoint", "finish_reason", "replica"], registry=r)
        self.rejected = Counter("triax_rejected_requests", "requests refused",
                                ["status"], registry=r)
        self.ttft = Histogram("triax_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("triax_inter_token_latency_seconds", "time between tokens",
                             buckets=_LATENCY, registry=r)
        self.latency = Histogram("triax_request_latency_seconds", "request latency",
                                 buckets=_LATENCY, registry=r)
