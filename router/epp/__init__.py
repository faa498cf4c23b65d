"""The Endpoint Picker front (`kvroute epp`): kvroute's decision inside a Gateway API
implementation, over Envoy's ext_proc protocol (GIE's Endpoint Picker Protocol).

:mod:`.protocol` (the protocol's names and messages), :mod:`.endpoints` (pods as
``ip:port``), :mod:`.picker` (the :class:`~router.core.RouterCore` of this front and what
goes where), :mod:`.stream` (one ext_proc stream, message by message),
:mod:`.accounting` (load, policy hooks and metrics of one request), :mod:`.usage` (the
usage in an answer), :mod:`.metrics` (``kvroute_epp_*``), :mod:`.server` (gRPC + health
+ /metrics), :mod:`.main` (the command).  See docs/gateway.md.
"""
