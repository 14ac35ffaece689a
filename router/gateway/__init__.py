"""kvfleet.router.gateway: the control plane of the router's optional Envoy gateway (DESIGN §1, §6).

The router serves Envoy its listeners and clusters over ADS (:mod:`.xds`, :mod:`.ads`)
and answers Envoy's ext_proc calls (:mod:`.extproc`) with the router's own decisions
behind a small interface (:mod:`.gate`). :mod:`.process` runs the real Envoy binary.
"""
