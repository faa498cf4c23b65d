"""Running one parsed request on the simulated pod: the P/D ``kv_transfer_params`` (the
decode side pulls remote blocks first, the prefill side holds its blocks for a puller)
and generation to the end, aborted when the client disconnects first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from router.sim.disagg import KVLoadError, PDRequest, SimDisagg
from router.sim.engine import SimEngine, SimRequest
from router.sim.wire import APIError, ClientDisconnected


class Execution:
    """Generation and the KV transfer around it, for one pod."""

    def __init__(self, engine: SimEngine, pd: SimDisagg) -> None:
        self.engine = engine
        self.pd = pd

    async def run(self, req: SimRequest, request: Request) -> None:
        """Generate to the end; a client that disconnects first aborts the request
        (as vLLM does), freeing its queue place or running slot."""

        async def consume() -> None:
            async with contextlib.aclosing(self.engine.generate(req)) as gen:
                async for _ in gen:
                    pass

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(consume())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled():
            raise ClientDisconnected()
        work.result()  # re-raises an engine error

    async def disagg(self, body: Mapping[str, Any], request: Request, req: SimRequest) -> PDRequest:
        """Parse ``kv_transfer_params`` and pull remote blocks (decode side) first."""
        pd = self.pd.parse(body, request.headers)
        try:
            await self.pd.receive(pd, req)
        except KVLoadError as exc:
            raise APIError(
                f"KV transfer failed (kv_load_failure_policy=fail): {exc}",
                status=500,
                type_="InternalServerError",
                param="kv_transfer_params",
            ) from None
        return pd

    def answer(self, out: dict[str, Any], pd: PDRequest, req: SimRequest) -> JSONResponse:
        """The JSON answer, with the ``kv_transfer_params`` a prefill pod hands on."""
        params = self.pd.hold(pd, req)
        if params is not None:
            out["kv_transfer_params"] = params
        return JSONResponse(out)
