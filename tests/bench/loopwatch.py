"""What holds an asyncio loop: a lag probe and a per-step CPU timer, for benchmarks.

* :meth:`LoopWatch.probe` sleeps 10 ms in a loop and records how late it wakes (the
  wait a health check or a request served by the same loop would see; wall time, so
  the OS running other processes counts too).
* While :attr:`LoopWatch.on`, every loop step (``Handle._run``: the code a task runs
  between two awaits, or one callback) is timed in *thread CPU time*, and the longest
  per task name is kept: what one step holds the loop for, whatever else the machine
  runs.  Task names lose their numeric suffix (``kv-events-replay-pod-1`` ->
  ``kv-events-replay-pod``).  The longest garbage collection is kept too: it lands in
  whichever step allocates, and no event code can avoid it.
"""

from __future__ import annotations

import asyncio
import gc
import time


class LoopWatch:
    def __init__(self) -> None:
        self.lag: list[float] = []
        self.longest: dict[str, float] = {}
        #: where each task of :attr:`longest` stopped after its longest step (the await
        #: that ended it: the long stretch ran just before it)
        self.where: dict[str, str] = {}
        self.on = False
        self.beat = 0.0  # the probe's last wake-up (0: not probing)
        real = asyncio.events.Handle._run
        watch = self

        def timed(handle: asyncio.events.Handle) -> None:
            if not watch.on:
                real(handle)
                return
            c0 = time.thread_time()
            real(handle)
            took = time.thread_time() - c0
            if took > 0.001:
                cb = getattr(handle._callback, "__self__", None)  # type: ignore[attr-defined]
                name = cb.get_name() if isinstance(cb, asyncio.Task) else "callback"
                name = name.rstrip("0123456789-") or name
                if took > watch.longest.get(name, 0.0):
                    watch.longest[name] = took
                    if isinstance(cb, asyncio.Task) and took > 0.02:
                        stack = cb.get_stack()
                        watch.where[name] = " <- ".join(
                            f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}"
                            for f in reversed(stack[-4:])
                        )

        asyncio.events.Handle._run = timed  # type: ignore[assignment]
        #: the longest garbage collection while on (it lands in whichever step allocates)
        self.gc_max = 0.0
        self._gc_t0 = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.thread_time()
        elif self.on:
            self.gc_max = max(self.gc_max, time.thread_time() - self._gc_t0)

    async def probe(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            self.beat = now = time.perf_counter()
            self.lag.append(now - t - 0.01)
        self.beat = 0.0

    def take(self) -> tuple[list[float], dict[str, float]]:
        """The lags and longest steps since the last call (and forget them)."""
        out = self.lag, self.longest
        self.lag, self.longest = [], {}
        return out

    def take_gc(self) -> float:
        """The longest garbage collection since the last call (CPU s), and forget it."""
        out, self.gc_max = self.gc_max, 0.0
        return out


def top_steps(longest: dict[str, float], n: int = 3) -> str:
    """``"name ms, ..."`` of the ``n`` longest steps (CPU ms), or a note that none was."""
    best = sorted(longest.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name} {1000 * t:.0f}" for name, t in best) or "none > 1 ms"
