"""Per-policy metrics from a :class:`~scoring.replay.engine.PolicyRun`, and the table.

* ``hit_rate`` — prompt tokens served from cache (GPU or CPU tier) / prompt tokens.
* ``ttft_p50_s`` / ``p90`` / ``p99`` — nearest-rank percentiles of TTFT (arrival to first
  token, queueing included).
* ``e2e_p50_s`` / ``p90`` / ``p99`` — the same of the end-to-end time (arrival to the
  last token: what a client waits for a JSON answer); ``json_e2e_p90_s`` — its p90 over
  the requests whose clients asked for a JSON answer (``--json-share``; None without).
* ``throughput_rps`` — requests / (last completion - first arrival).
* ``imbalance`` — max / mean of per-pod busy time (simple pods: seconds spent
  prefilling; vLLM pods: seconds running engine steps); 1.0 is perfectly even.
  ``max_utilisation`` / ``mean_utilisation`` are busy time over the replay's span.
* ``rejected`` — requests a pod refused (vLLM pods: prompt >= ``max_model_len``); they
  have no TTFT and are left out of the percentiles.  ``preemptions`` — running requests
  a vLLM pod preempted for lack of KV blocks; ``engine_steps`` — steps the vLLM pods ran.
"""

from __future__ import annotations

import math
from typing import Any

from scoring.replay.engine import PolicyRun
from scoring.replay.workload import percentile


def summarize(run: PolicyRun) -> dict[str, Any]:
    prompt = sum(run.prompt_tokens)
    n = len(run.ttft_s)
    ttft = [x for x in run.ttft_s if not math.isnan(x)] if run.rejected else run.ttft_s
    e2e = [x for x in run.e2e_s if not math.isnan(x)] if run.rejected else run.e2e_s
    # (a run built without the replay's json_answer list has no JSON clients)
    answers = zip(run.e2e_s, run.json_answer, strict=False)
    json_e2e = [x for x, j in answers if j and not math.isnan(x)]
    span = max(run.last_finish_s - run.first_arrival_s, 1e-9)
    busy = run.busy_s
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    per_pod = [0] * len(run.pods)
    for i in run.pod_of:
        per_pod[i] += 1
    return {
        "hit_rate": sum(run.hit_tokens) / prompt if prompt else 0.0,
        "gpu_hit_rate": sum(run.gpu_hit_tokens) / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p90_s": percentile(e2e, 90),
        "e2e_p99_s": percentile(e2e, 99),
        "json_e2e_p90_s": percentile(json_e2e, 90) if json_e2e else None,
        "throughput_rps": n / span,
        "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
        "max_utilisation": max(busy) / span if busy else 0.0,
        "mean_utilisation": mean_busy / span,
        "requests_per_pod": per_pod,
        "replay_wall_s": run.wall_s,
        "rejected": run.rejected,
        "preemptions": run.preemptions,
        "engine_steps": run.engine_steps,
    }


def _fleet_line(fleet: dict[str, Any]) -> str:
    head = f"fleet: {fleet['pods']} pods x {fleet['capacity_tokens']:,} tokens, "
    if fleet.get("pod_model") == "vllm":
        e = fleet["engine"]
        return head + (
            f"pod model vllm, preset {e['name']}, max_num_batched_tokens "
            f"{e['max_num_batched_tokens']:,}, max_num_seqs {e['max_num_seqs']:,}"
        )
    return head + (
        f"prefill {fleet['prefill_rate']:,.0f} tok/s, decode {fleet['decode_rate']:,.0f} tok/s"
    )


def format_table(result: dict[str, Any]) -> str:
    """A plain-text report: workload, ceilings, one row per policy."""
    w = result["workload"]
    c = result["ceilings"]
    pt = w["prompt_tokens"]
    lines = [
        f"trace: {result['trace']['path']} ({result['trace']['format']}"
        + (", CHARACTER ESTIMATE of tokens" if result["trace"]["approximate"] else "")
        + f"), {w['requests']} requests, {result['trace']['malformed']} malformed lines skipped",
        _fleet_line(result["fleet"]),
        f"prompt tokens: mean {pt['mean']:,.0f}  p50 {pt['p50']:,.0f}  p90 {pt['p90']:,.0f}  "
        f"p99 {pt['p99']:,.0f}  max {pt['max']:,}",
        f"prefix share rate {w['prefix_share_rate']:.1%}   prefix breakers "
        f"{w['prefix_breakers']:.1%}   " + turns_line(w),
        f"ceilings: infinite cache {c['infinite']:.1%}   pooled cache {c['pooled']:.1%}",
        "",
    ]
    header = (
        f"{'policy':<15} {'hit':>7} {'/pooled':>8} {'p50 s':>8} {'p90 s':>8} {'p99 s':>8} "
        f"{'p90/rr':>7} {'req/s':>7} {'imbal':>6} {'wall s':>7}"
    )
    lines += [header, "-" * len(header)]
    rr = result["policies"].get("round_robin")
    for name, m in result["policies"].items():
        rel = m["ttft_p90_s"] / rr["ttft_p90_s"] if rr and rr["ttft_p90_s"] > 0 else None
        pooled = m["hit_rate"] / c["pooled"] if c["pooled"] > 0 else None
        lines.append(
            f"{name:<15} {m['hit_rate']:>7.1%} "
            f"{(f'{pooled:.1%}' if pooled is not None else '-'):>8} "
            f"{m['ttft_p50_s']:>8.2f} {m['ttft_p90_s']:>8.2f} {m['ttft_p99_s']:>8.2f} "
            f"{(f'{rel:.2f}' if rel is not None else '-'):>7} "
            f"{m['throughput_rps']:>7.2f} {m['imbalance']:>6.2f} {m['replay_wall_s']:>7.1f}"
        )
    if result["fleet"].get("pod_model") == "vllm":
        lines.append("")
        lines.append(
            "vllm pods: preemptions / rejected / engine steps: "
            + ", ".join(
                f"{name} {m['preemptions']:,} / {m['rejected']:,} / {m['engine_steps']:,}"
                for name, m in result["policies"].items()
            )
        )
    return "\n".join(lines)


def turns_line(w: dict[str, Any]) -> str:
    """``turns/conversation 5.0 (21 conversations)`` when sessions are known, else the
    user turns per request, else ``unknown``."""
    conv = w.get("turns_per_conversation")
    if conv:
        return f"turns/conversation {conv['mean']:.1f} ({w['conversations']} conversations)"
    per_request = w.get("user_turns_per_request")
    if per_request:
        return f"user turns/request {per_request['mean']:.1f} (no session ids)"
    return "turns unknown"
