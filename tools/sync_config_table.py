"""Rewrite the settings table in README.md and docs/config.md from the config model
(``python tools/sync_config_table.py``); tests/router/test_config.py checks they match."""

from __future__ import annotations

from pathlib import Path

from router.config import config_table

HEADER = "| setting | env var | CLI flag | default | type; meaning |"


def sync(path: Path, table: str) -> bool:
    lines = path.read_text().split("\n")
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    new = [*lines[:start], *table.rstrip("\n").split("\n"), *lines[end:]]
    if new == lines:
        return False
    path.write_text("\n".join(new))
    return True


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    table = config_table()
    for name in ("README.md", "docs/config.md"):
        if sync(root / name, table):
            print(f"updated {name}")
