"""The simulated pod's ``/metrics``: vLLM's metric names, labels and buckets.

Each pod owns a :class:`prometheus_client.CollectorRegistry` (several pods share one
process).  Labels are ``model_name`` and ``engine="0"`` as in vLLM 0.32
(``vllm/v1/metrics/loggers.py``); ``vllm:cache_config_info`` carries vLLM's
``CacheConfig.metrics_info()`` label set plus ``engine`` (no ``model_name``).
Prefix-cache counters count *tokens*: queries += prompt tokens, hits += tokens
served from cache.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.sim.settings import SimSettings

# vllm/v1/metrics/buckets.py
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's ``vllm:inter_token_latency_seconds`` buckets (``vllm/v1/metrics/loggers.py``)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def cache_config_labels(settings: SimSettings) -> dict[str, str]:
    """vLLM 0.32's ``vllm:cache_config_info`` labels, filled from the settings."""
    blocks = settings.capacity_blocks
    return {
        "_block_size_resolved": "True",
        "block_size": str(settings.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(settings.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.92",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(
            round(blocks * settings.block_size / settings.max_model_len, 2)
        ),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(blocks * settings.block_size),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


class SimMetrics:
    """One pod's metrics.  Gauges read live state through callbacks at scrape time."""

    def __init__(
        self,
        settings: SimSettings,
        *,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        names = ["model_name", "engine"]
        labels = (settings.model, "0")

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, names, registry=r).labels(*labels).set_function(fn)

        gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", running
        )
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*labels)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: success.labels(*labels, reason) for reason in FINISHED_REASONS
        }

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*labels)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        # vLLM's engine-side phases (``vllm/v1/metrics/loggers.py``): scheduled -> first
        # token, first -> last token; what ``kvroute calibrate`` reads
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        #: not a vLLM metric: requests the sim rejected, by HTTP status
        self._rejected = Counter(
            "kvroute_sim_rejected_requests",
            "Requests the simulated pod rejected, by HTTP status.",
            ["status"],
            registry=r,
        )
        info_labels = cache_config_labels(settings)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info_labels),
            registry=r,
        ).labels(**info_labels).set(1)

    def rejected(self, status: int) -> None:
        self._rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
