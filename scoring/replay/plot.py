"""``--plot FILE.png``: hit rate per policy (bars, ceilings as lines) and TTFT CDFs.

The figure stands alone when shared: its title names the trace, the fleet and the cache
size; every bar carries its value; the TTFT axis starts near the fastest request; and
curves that coincide (two policies placing every request alike) stay visible, each with
its own line style and marker, and the legend says which ones are identical.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: line styles and markers cycled over the policies, so coinciding curves stay apart
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (the ``plot`` extra)."""


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailable` unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed: pip install 'kvroute[plot]'") from None


def title(result: Mapping[str, Any]) -> str:
    fleet = result["fleet"]
    trace = Path(str(result["trace"]["path"])).name
    return (
        f"{trace}: {result['trace']['requests']:,} requests on {fleet['pods']} pods x "
        f"{fleet['capacity_tokens']:,} KV tokens"
    )


def _identical(ttfts: Mapping[str, Sequence[float]]) -> dict[str, str]:
    """policy -> the first earlier policy whose TTFTs are exactly its own."""
    same: dict[str, str] = {}
    seen: list[tuple[str, Sequence[float]]] = []
    for name, values in ttfts.items():
        for other, v in seen:
            if list(v) == list(values):
                same[name] = other
                break
        else:
            seen.append((name, values))
    return same


def render(result: Mapping[str, Any], ttfts: Mapping[str, Sequence[float]]) -> bytes:
    """The figure as PNG bytes."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    fig, (ax_hit, ax_cdf) = plt.subplots(1, 2, figsize=(13, 5))
    fig.suptitle(title(result))
    hits = [result["policies"][n]["hit_rate"] for n in names]
    bars = ax_hit.bar(names, hits, color="tab:blue")
    ax_hit.bar_label(bars, labels=[f"{h:.1%}" for h in hits], padding=2, fontsize=8)
    for label, style in (("infinite", "--"), ("pooled", ":")):
        value = result["ceilings"][label]
        ax_hit.axhline(value, color="black", linestyle=style, label=f"{label} {value:.1%}")
    ax_hit.set_ylabel("token hit rate")
    ax_hit.set_ylim(0, max([*hits, result["ceilings"]["infinite"], 0.01]) * 1.15)
    ax_hit.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax_hit.set_title("hit rate (lines: ceilings)")
    ax_hit.tick_params(axis="x", rotation=30)
    ax_hit.legend(fontsize=8)
    same = _identical(ttfts)
    lowest = min((min(v) for v in ttfts.values() if v), default=1e-3)
    for i, n in enumerate(names):
        xs = sorted(max(t, 1e-4) for t in ttfts.get(n, ()))
        if not xs:
            continue
        ys = [(k + 1) / len(xs) for k in range(len(xs))]
        label = n if n not in same else f"{n} (= {same[n]})"
        ax_cdf.plot(
            xs,
            ys,
            label=label,
            linestyle=_STYLES[i % len(_STYLES)],
            marker=_MARKERS[i % len(_MARKERS)],
            markevery=max(1, len(xs) // 8),
            markersize=5,
            linewidth=2.2 if n not in same else 1.2,
        )
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlim(left=max(lowest, 1e-4) / 1.5)
    ax_cdf.set_xlabel("TTFT (s, log)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_plot(
    path: str | Path,
    result: Mapping[str, Any],
    ttfts: Mapping[str, Sequence[float]],
) -> None:
    Path(path).write_bytes(render(result, ttfts))
