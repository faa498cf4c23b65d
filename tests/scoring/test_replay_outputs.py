"""`kvroute replay`'s outputs as a report worth sharing: a bad --plot or --report is
refused before the replay runs, the table prints whatever happens to the plot, the plot
stands alone, and --report writes one self-contained HTML page."""

from __future__ import annotations

import base64
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from scoring.replay.cli import main
from scoring.replay.plot import _identical, title
from tests.scoring.test_replay import conversations, write_jsonl


def _trace(tmp_path: Path) -> str:
    return str(write_jsonl(tmp_path / "conv.jsonl", list(conversations(n_conv=6, turns=3))))


def _args(tmp_path: Path, *extra: str) -> list[str]:
    base = [_trace(tmp_path), "--pods", "2", "--capacity-tokens", "20000"]
    return [*base, "--policy", "cost", "--policy", "round_robin", "--no-progress", *extra]


def test_a_plot_into_a_missing_directory_is_refused_before_replaying(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(tmp_path, "--plot", str(tmp_path / "nowhere" / "p.png"))) == 2
    out = capsys.readouterr()
    assert "no such directory" in out.err
    assert "policy" not in out.out  # nothing was replayed


def test_a_plot_without_matplotlib_is_refused_naming_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert main(_args(tmp_path, "--plot", str(tmp_path / "p.png"))) == 2
    assert "kvroute[plot]" in capsys.readouterr().err


def test_the_table_prints_even_when_writing_the_plot_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a-directory.png"
    target.mkdir()  # the directory exists and is writable; the file cannot be written
    assert main(_args(tmp_path, "--plot", str(target))) == 1
    out = capsys.readouterr()
    assert "round_robin" in out.out and "cost" in out.out
    assert f"--plot {target}" in out.err


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []
        self.images: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if key in ("src", "href") and value and not value.startswith("data:"):
                self.external.append(value)
            if tag == "img" and key == "src" and value:
                self.images.append(value)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_the_html_report_is_one_self_contained_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "replay.html"
    assert main(_args(tmp_path, "--report", str(report))) == 0
    page = _Page()
    page.feed(report.read_text())
    text = " ".join(page.text)
    assert page.external == []  # nothing to fetch: it can be mailed as it is
    for expected in ("Workload", "prompt tokens", "prefix breakers", "Ceilings", "cost"):
        assert expected in text
    assert "round_robin" in text
    (img,) = page.images
    png = base64.b64decode(img.split(",", 1)[1])
    assert png.startswith(b"\x89PNG")


def test_without_matplotlib_the_report_still_carries_the_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = tmp_path / "replay.html"
    assert main(_args(tmp_path, "--report", str(report))) == 0
    html = report.read_text()
    assert "No plot: matplotlib is not installed" in html and "round_robin" in html


def test_the_plot_names_its_trace_and_fleet_and_tells_identical_curves_apart() -> None:
    result = {
        "trace": {"path": "/data/agent.jsonl", "requests": 1200},
        "fleet": {"pods": 8, "capacity_tokens": 300_000},
    }
    assert title(result) == "agent.jsonl: 1,200 requests on 8 pods x 300,000 KV tokens"
    same = _identical({"least_load": [1.0, 2.0], "session": [1.0, 2.0], "cost": [0.5, 2.0]})
    assert same == {"session": "least_load"}


def test_the_plot_is_a_png_with_every_policy(tmp_path: Path) -> None:
    plot = tmp_path / "p.png"
    assert main(_args(tmp_path, "--plot", str(plot))) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
