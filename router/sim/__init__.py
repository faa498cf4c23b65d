"""A simulated vLLM pod (``kvroute sim``): the embedded default fleet, the test
fixture and the benchmark cluster.

It looks to the router like a real vLLM pod: the OpenAI endpoints, ``/tokenize``,
``/metrics`` with vLLM's names, KV events in vLLM's ZMQ wire format with a replay
socket, an LRU prefix cache and a TTFT model (see :mod:`router.sim.engine`).
"""

from router.sim.pod import SimPod
from router.sim.settings import SimSettings

__all__ = ["SimPod", "SimSettings"]
