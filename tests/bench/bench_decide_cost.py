"""The decision's CPU cost per request, in whichever source tree runs it, to set two trees
side by side (issue #9's bound: within 10% of its tree's).

    python tests/bench/bench_decide_cost.py [--requests 10000] [--repeat 3] [--instructions]
    cd DIR && PYTHONPATH=DIR python /path/to/bench_decide_cost.py   # an older tree

``bench_hot_path.py``'s ``decide`` loop without the rest of that bench: 4 simulated pods
(``kvroute sim --time-scale 0``), `kvroute serve`'s app built in this process,
``RequestRouter.decide`` on the tiny completion of ``bench_router_overhead.py``, and the
policy's hooks after it.  Three loops, each ``--requests`` long, ``--repeat`` times in
turn; the median CPU microseconds per request of each:

* ``decide``   — the decision alone;
* ``decide+2`` — with ``on_routed`` and ``on_complete``;
* ``decide+4`` — with ``on_first_token`` and ``on_finished`` too (a tree whose policy
  lacks them runs without them: then it equals ``decide+2``; as the router, it does not
  call the base class's no-op ``on_finished``).

``--instructions``: instead of CPU time, the CPU instructions per request of each loop,
which do not move with the machine's load: the bench re-runs itself under ``valgrind
--tool=callgrind`` (Debian: ``valgrind``) once per loop (``--only``: that loop alone)
with ``--requests`` and once with three times as many, and divides the difference by
the extra requests (start-up, warm-up and the pods' start cancel out).  Those runs
scrape and health-check the pods every 300 s (``--quiet``): at valgrind's pace the
default intervals put the router's background work into the loops, more of it the
busier the machine (session 33 saw the same tree's counts move by 3%).  With it, two
runs of one tree agreed within 0.3% on ``decide`` and ``decide+4`` and still differed
by 2.8% on ``decide+2``: compare differences of a few percent over several runs.  About a minute
per loop.  CPU time and instructions need not move together (a change can lose or gain
cache locality): quote both.

It imports the app from ``router.proxy.app`` or, in a tree from before the layout move
(issue #9's ``eb283af``), from ``router.app``.  Run the trees in turn, several times: the
machine is shared.  Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router_overhead as overhead

try:
    from router.decision.request import parse_body
    from router.proxy.app import create_app
except ImportError:  # a tree from before the layout move
    from router.app import create_app
    from router.routing import parse_body
from router.config import Settings
from scoring.policies.base import Policy

HEADERS = {"host": "127.0.0.1", "content-type": "application/json"}


LOOPS = ("decide", "decide+2", "decide+4")


def known(flags: list[str]) -> list[str]:
    """The ``--section.name value`` pairs of ``flags`` this tree's settings have (an
    older tree may lack a section or a setting)."""
    out: list[str] = []
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        section, _, name = flag[2:].partition(".")
        field = Settings.model_fields.get(section)
        fields = getattr(field.annotation, "model_fields", {}) if field is not None else {}
        if name.replace("-", "_") in fields:
            out += [flag, value]
    return out


async def loops(
    urls: list[str], n: int, repeat: int, only: str | None = None, quiet: bool = False
) -> dict[str, list[float]]:
    static = [{"name": f"sim-{i}", "url": u, "models": ["sim-model"]} for i, u in enumerate(urls)]
    args = ["--discovery.static", json.dumps(static), "--log-level", "warning"]
    settings = Settings.load([*args, *(known(overhead.QUIET_BACKGROUND) if quiet else [])])
    app = create_app(settings)
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    lifespan = asyncio.create_task(app(scope, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app did not start: {started}")
    try:
        router, policy = app.state.gateway.router, app.state.gateway.policy
        first = getattr(policy, "on_first_token", None)
        finished = getattr(policy, "on_finished", None)
        # the router calls no base no-op on_finished (router/proxy/bookkeeping.py)
        base_hook = getattr(Policy, "on_finished", None)  # (none in an older tree)
        if finished is not None and type(policy).on_finished is base_hook:
            finished = None
        body = overhead.BODY
        for _ in range(1000):  # warm up
            await router.decide("completion", parse_body(body), HEADERS)
        out: dict[str, list[float]] = {name: [] for name in LOOPS if only in (None, name)}
        for _ in range(repeat):
            for name in out:
                t0 = time.process_time()
                for _ in range(n):
                    routed = await router.decide("completion", parse_body(body), HEADERS)
                    if name == "decide":
                        continue
                    route, pod = routed.route, routed.ranking[0]
                    policy.on_routed(route, pod)
                    if name == "decide+4":
                        if first is not None:
                            first(route, pod, 0.01)
                        if finished is not None:
                            finished(route, pod, None)
                    policy.on_complete(route, pod)
                out[name].append(1e6 * (time.process_time() - t0) / n)
        return out
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await lifespan


def instructions(requests: int, only: str | None = None) -> dict[str, float]:
    """Instructions per request of each loop, or of ``only`` (``--instructions``, module
    docstring)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit(
            "bench_decide_cost: --instructions needs valgrind (apt-get install valgrind)"
        )
    out: dict[str, float] = {}
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    for loop in LOOPS if only is None else (only,):
        counts = []
        for n in (requests, 3 * requests):
            cmd = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null"]
            cmd += [sys.executable, __file__, "--requests", str(n), "--repeat", "1", "--quiet"]
            run = subprocess.run(
                [*cmd, "--only", loop],
                env=env,
                capture_output=True,
                text=True,
            )
            found = re.search(r"Collected : (\d+)", run.stderr)
            if run.returncode != 0 or found is None:
                raise SystemExit(f"bench_decide_cost: valgrind run failed: {run.stderr[-500:]}")
            counts.append(int(found.group(1)))
        out[loop] = round((counts[1] - counts[0]) / (2 * requests))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=LOOPS, help="run this loop alone")
    ap.add_argument(
        "--instructions", action="store_true", help="instructions per request (valgrind)"
    )
    ap.add_argument(
        "--quiet",
        action="store_true",
        help="scrapes and health checks every 300 s (--instructions' runs under valgrind)",
    )
    a = ap.parse_args()
    if a.requests < 1 or a.repeat < 1:
        print("bench_decide_cost: --requests and --repeat must be >= 1", file=sys.stderr)
        return 2
    if a.instructions:
        print(json.dumps(instructions(a.requests, a.only)))
        return 0
    sims = [overhead.start_sim(i) for i in range(4)]
    try:
        for _, url in sims:
            overhead.wait_completion(int(url.rsplit(":", 1)[1]))
        out = uvloop.run(loops([u for _, u in sims], a.requests, a.repeat, a.only, a.quiet))
    finally:
        for proc, _ in sims:
            proc.stop()
    print(json.dumps({k: round(statistics.median(v), 2) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
