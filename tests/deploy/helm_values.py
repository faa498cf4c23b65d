"""The values the Helm chart tests render with: the release, and each deployment mode
the chart supports (:data:`MODES`), as the values a user would pass; no Helm needed."""

from __future__ import annotations

from typing import Any

RELEASE = "kv"
NAMESPACE = "serving"
CONFIG_KEY = "kvroute.yaml"

STATIC_PODS = {
    "discovery": {
        "kind": "static",
        "static": [
            {
                "name": "vllm-0",
                "url": "http://10.0.0.7:8000",
                "events_endpoint": "tcp://10.0.0.7:5557",
                "replay_endpoint": "tcp://10.0.0.7:5657",
                "models": ["Qwen3-8B"],
            },
            {"name": "vllm-1", "url": "http://10.0.0.8:8000", "models": ["Qwen3-8B"]},
        ],
    }
}
K8S_DISCOVERY = {
    "discovery": {
        "kind": "k8s",
        "k8s": {"label_selector": "app=vllm", "events_port": 5557, "replay_port": 5657},
    }
}
#: prefill/decode pools (docs/deploy.md): static pods with roles, the split's settings
PD_STATIC_POOLS = {
    "discovery": {
        "kind": "static",
        "static": [
            {"name": "prefill-0", "url": "http://10.0.1.7:8000", "role": "prefill"},
            {"name": "decode-0", "url": "http://10.0.2.7:8000", "role": "decode"},
        ],
    },
    "pd": {"prefill_policy": "cost", "params": {"min_uncached_tokens": 512}, "kv_lease_s": 30},
}
#: the same pools from pod labels (kvroute.io/role, or llm-d's llm-d.ai/role)
PD_K8S_POOLS = {
    "discovery": {
        "kind": "k8s",
        "k8s": {"label_selector": "app=vllm", "events_port": 5557, "role": "decode"},
    },
    "pd": {"params": {"always_split": False}},
}

#: each deployment mode the chart supports, as the values a user would pass
MODES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "static pods": {"config": STATIC_PODS},
    "kubernetes discovery": {"config": K8S_DISCOVERY},
    "dns discovery": {
        "config": {"discovery": {"kind": "dns", "dns": {"hostname": "vllm-headless"}}}
    },
    "redis external": {
        "replicaCount": 3,
        "redis": {"url": "redis://valkey.cache.svc:6379/0"},
        "config": K8S_DISCOVERY,
    },
    "redis bundled + indexer": {
        "replicaCount": 2,
        "redis": {"enabled": True},
        "config": STATIC_PODS,
    },
    "redis without indexer, one writing replica": {
        "redis": {"enabled": True},
        "indexer": {"enabled": False},
        "config": {"index_writer": True, **STATIC_PODS},
    },
    "serviceMonitor + prometheusRule on": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "hpa on": {"autoscaling": {"enabled": True}, "redis": {"enabled": True}},
    "pdb on": {"podDisruptionBudget": {"enabled": True}, "replicaCount": 2},
    "dashboards off": {"dashboards": {"enabled": False}},
    "prefill/decode pools, static": {"config": PD_STATIC_POOLS},
    "prefill/decode pools, kubernetes labels": {"config": PD_K8S_POOLS},
}
