"""The EPP front's own Prometheus families (prefix ``kvroute_epp_``), registered in
the core's registry beside the ``kvroute_*`` metrics every front shares."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.metric_families import HotFamily


class EppMetrics:
    """The families of one EPP."""

    def __init__(self, r: CollectorRegistry, unaddressable: Callable[[], int]) -> None:
        self.streams = Counter(
            "kvroute_epp_streams",
            "ext_proc streams handled, by outcome: picked (endpoints sent), rejected "
            "(an immediate response: 4xx / 503), passed (no body to route: least loaded), "
            "error (a protocol error; the stream was closed), bookkeeping_error (the "
            "load or completion accounting failed after the answers were sent; the stream "
            "went on)",
            ["outcome"],
            registry=r,
        )
        self.served_elsewhere = Counter(
            "kvroute_epp_served_elsewhere",
            "Requests the proxy reported served by another endpoint than the first picked "
            "(its retries went down the list); load and metrics follow the served one",
            registry=r,
        )
        self.usage_tokens = HotFamily(
            "counter",
            "kvroute_epp_usage_tokens",
            "Tokens in the answers' usage, by model, pod and kind (prompt, completion, "
            "cached = the engine's prompt_tokens_details.cached_tokens)",
            ("model", "pod", "kind"),
        )
        r.register(self.usage_tokens)
        self.protocol_errors = Counter(
            "kvroute_epp_protocol_errors",
            "ext_proc messages the EPP could not use, by reason",
            ["reason"],
            registry=r,
        )
        self.unaddressable = Gauge(
            "kvroute_epp_unaddressable_pods",
            "Pods left out of picks because their URL names no IP address",
            registry=r,
        )
        self.unaddressable.set_function(lambda: float(unaddressable()))

    def forget_pod(self, pod: str) -> None:
        """Drop a departed pod's series."""
        self.usage_tokens.remove_where("pod", pod)
