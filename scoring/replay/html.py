"""``--report FILE.html``: one self-contained page to send to a team before adopting a
policy — the workload's profile (prompt lengths, turns, prefix share, prefix breakers),
the ceilings, the policy table and the plots (embedded as a PNG, no external files).
Without matplotlib the page says so and carries everything but the plot."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from scoring.replay.plot import PlotUnavailable, render, title
from scoring.replay.report import turns_line

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222 }
table { border-collapse: collapse; margin: 1em 0 }
th, td { border: 1px solid #ccc; padding: .3em .7em; text-align: right }
th:first-child, td:first-child { text-align: left }
th { background: #f3f3f3 }
.note { color: #666; font-size: .9em }
img { max-width: 100% }
"""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _profile(result: Mapping[str, Any]) -> str:
    w = result["workload"]
    pt = w["prompt_tokens"]
    rows = [
        ["requests", f"{w['requests']:,}"],
        ["duration", f"{w['duration_s']:,.0f} s"],
        [
            "prompt tokens",
            f"mean {pt['mean']:,.0f} · p10 {pt['p10']:,.0f} · p50 {pt['p50']:,.0f} · "
            f"p90 {pt['p90']:,.0f} · p99 {pt['p99']:,.0f} · max {pt['max']:,}",
        ],
        ["output tokens (mean)", f"{w['output_tokens_mean']:,.0f}"],
        ["turns", turns_line(dict(w))],
        ["prefix share rate (first block seen before)", f"{w['prefix_share_rate']:.1%}"],
        ["prefix breakers (first block unique)", f"{w['prefix_breakers']:.1%}"],
        ["shorter than one block", f"{w['no_full_block']:.1%}"],
    ]
    return _table(["workload", ""], rows)


def _policies(result: Mapping[str, Any]) -> str:
    pooled = result["ceilings"]["pooled"]
    rows = []
    for name, m in result["policies"].items():
        rows.append(
            [
                name,
                f"{m['hit_rate']:.1%}",
                f"{m['hit_rate'] / pooled:.1%}" if pooled > 0 else "-",
                f"{m['ttft_p50_s']:.3f}",
                f"{m['ttft_p90_s']:.3f}",
                f"{m['ttft_p99_s']:.3f}",
                f"{m['throughput_rps']:.2f}",
                f"{m['imbalance']:.2f}",
            ]
        )
    header = ["policy", "hit rate", "of pooled", "TTFT p50 s", "p90 s", "p99 s", "req/s", "imbal."]
    return _table(header, rows)


def report_html(result: Mapping[str, Any], ttfts: Mapping[str, Sequence[float]]) -> str:
    """The page as a string."""
    fleet = result["fleet"]
    c = result["ceilings"]
    try:
        png = base64.b64encode(render(result, ttfts)).decode("ascii")
        figure = f'<img alt="hit rate and TTFT per policy" src="data:image/png;base64,{png}">'
    except PlotUnavailable as exc:
        figure = f'<p class="note">No plot: {escape(str(exc))}.</p>'
    estimate = (
        '<p class="note">Token counts are a CHARACTER ESTIMATE (no --tokenizer).</p>'
        if result["trace"]["approximate"]
        else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>kvroute replay: {escape(title(result))}</title><style>{_CSS}</style></head>
<body>
<h1>kvroute replay</h1>
<p>{escape(title(result))}; prefill {fleet["prefill_rate"]:,.0f} tokens/s and decode
{fleet["decode_rate"]:,.0f} tokens/s per pod; trace {escape(str(result["trace"]["path"]))}
({escape(str(result["trace"]["format"]))}, {result["trace"]["malformed"]} malformed lines
skipped).</p>
{estimate}
<h2>Workload</h2>
{_profile(result)}
<h2>Ceilings</h2>
<p>No policy can beat these: an infinite cache shared by the fleet serves
<b>{c["infinite"]:.1%}</b> of prompt tokens from cache; one LRU cache of the fleet's
total size, <b>{c["pooled"]:.1%}</b>.</p>
<h2>Policies</h2>
{_policies(result)}
<p class="note">TTFT: arrival to first token, queueing included. Imbalance: max / mean of
per-pod busy time (1.00 = even).</p>
{figure}
<p class="note">Made by <code>kvroute replay --report</code>; reproduce with the same
trace and options.</p>
</body></html>
"""


def write_report(
    path: str | Path, result: Mapping[str, Any], ttfts: Mapping[str, Sequence[float]]
) -> None:
    Path(path).write_text(report_html(result, ttfts), encoding="utf-8")
