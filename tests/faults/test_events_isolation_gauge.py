"""Isolated KV-event ingestion (issue #10): the ``kvroute_index_entries`` gauge of a
cleared pod drops to zero.
"""

from __future__ import annotations

from router.config import Settings
from router.core import RouterCore
from router.fleet.pods import PodSpec
from scoring.blocks import BlockHasher
from tests.support.kv_events import (
    BS,
    MODEL,
    chain,
)


async def test_the_index_entries_gauge_drops_to_zero_when_a_pod_is_cleared() -> None:
    core = RouterCore(Settings())
    try:
        core.registry.set_pods([PodSpec(name=n, url="http://127.0.0.1:1") for n in ("a", "b")])
        keys = BlockHasher(BS, MODEL).keys(chain(3))
        await core.index.add("a", keys)
        await core.index.add("b", keys[:1])
        await core.update_index_gauge()
        text = core.metrics.render().decode()
        assert 'kvroute_index_entries{pod="a"} 3.0' in text
        await core.index.clear_pod("a")  # what a resync does
        await core.update_index_gauge()
        text = core.metrics.render().decode()
        assert 'kvroute_index_entries{pod="a"} 0.0' in text
        assert 'kvroute_index_entries{pod="b"} 1.0' in text
    finally:
        await core.stop()
