"""``--plot FILE.png``: hit rate per policy (bars, ceilings as lines) and TTFT CDFs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def write_plot(
    path: str | Path,
    result: Mapping[str, Any],
    ttfts: Mapping[str, Sequence[float]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    fig, (ax_hit, ax_cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    hits = [result["policies"][n]["hit_rate"] for n in names]
    ax_hit.bar(names, hits, color="tab:blue")
    for label, style in (("infinite", "--"), ("pooled", ":")):
        ax_hit.axhline(result["ceilings"][label], color="black", linestyle=style, label=label)
    ax_hit.set_ylabel("token hit rate")
    ax_hit.set_title("hit rate (lines: ceilings)")
    ax_hit.tick_params(axis="x", rotation=30)
    ax_hit.legend()
    for n in names:
        xs = sorted(max(t, 1e-4) for t in ttfts[n])
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax_cdf.plot(xs, ys, label=n)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
