"""Every relative link in the repository's Markdown resolves: the file it names exists
and, for a Markdown target, so does the heading its ``#fragment`` names (GitHub's
anchors).  Records move between the README and ``docs/`` (``docs/history/``); a link
left behind fails here, not in a reader's browser."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: ``[text](target)``, not an image; the target up to its first space or ``)``
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_SKIP = {".git", ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules"}


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """The lines of ``text`` not inside a fenced code block, numbered from 1."""
    out: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {
        _slug(line.lstrip("#"))
        for _, line in _outside_fences(doc.read_text())
        if line.startswith("#")
    }


def broken_links(doc: Path) -> list[str]:
    """``doc``'s relative links that name no file, or no heading of a Markdown file."""
    broken: list[str] = []
    for n, line in _outside_fences(doc.read_text()):
        for match in _LINK.finditer(line):
            target = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (doc.parent / path) if path else doc
            if not resolved.exists():
                broken.append(f"{doc.name}:{n}: {target} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
                broken.append(f"{doc.name}:{n}: {target} (no such heading)")
    return broken


def _docs() -> list[Path]:
    return sorted(
        p for p in ROOT.rglob("*.md") if not _SKIP.intersection(p.relative_to(ROOT).parts)
    )


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "guide.md").write_text("# Set up\n\n## Two words\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "[ok](guide.md) [ok](guide.md#two-words) [ok](#top) [web](https://x.test/a)\n"
        "# Top\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[gone](nowhere.md) [no heading](guide.md#three-words)\n"
    )
    assert broken_links(doc) == [
        "README.md:6: nowhere.md (no such file)",
        "README.md:6: guide.md#three-words (no such heading)",
    ]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_readme_and_the_history_it_points_to_are_checked() -> None:
    names = {str(p.relative_to(ROOT)) for p in _docs()}
    assert {"README.md", "docs/history/quality_matrix.md", "docs/history/overhead.md"} <= names
