"""What the JSON depth limit costs ``parse_body``, per body shape (CPU, in process).

    python tests/bench/bench_parse_body.py [--repeat 7]

For each body: ``msgspec.json.decode`` alone, ``parse_body`` with the default limit
(``proxy.max_json_depth`` = 128: bodies with more than 128 brackets are walked), and
``parse_body`` with a limit no body reaches the gate of (the bracket count only).  Best of
``--repeat`` runs, microseconds per call.  Bodies:

* ``completion``  — bench_router_overhead.py's tiny completion (1 bracket: no walk);
* ``chat 20``     — 20 chat messages with string contents (41 brackets: no walk);
* ``chat 100``    — 100 messages with content parts and one tool (300+ brackets: walked).
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router_overhead as overhead

from router.decision.request import parse_body


def bodies() -> dict[str, bytes]:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
    chat20 = [{"role": "user", "content": "hello " * 20} for _ in range(20)]
    chat100 = [
        {"role": "user", "content": [{"type": "text", "text": "hello " * 20}]} for _ in range(100)
    ]
    return {
        "completion": overhead.BODY,
        "chat 20": json.dumps({"model": "m", "messages": chat20}).encode(),
        "chat 100": json.dumps({"model": "m", "messages": chat100, "tools": [tool]}).encode(),
    }


def best_us(fn: object, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    print("| body | bytes | brackets | decode us | parse_body us | parse_body, no walk us |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, raw in bodies().items():
        number = 100_000 if len(raw) < 1000 else 2_000
        brackets = raw.count(b"{") + raw.count(b"[")
        decode = best_us(lambda raw=raw: msgspec.json.decode(raw), number, args.repeat)
        parse = best_us(lambda raw=raw: parse_body(raw), number, args.repeat)
        no_walk = best_us(lambda raw=raw: parse_body(raw, 1 << 30), number, args.repeat)
        print(f"| {name} | {len(raw)} | {brackets} | {decode:.2f} | {parse:.2f} | {no_walk:.2f} |")


if __name__ == "__main__":
    main()
