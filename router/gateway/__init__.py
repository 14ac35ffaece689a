"""kvfleet.router.gateway: the control plane of the router's optional Envoy gateway (docs/architecture.md §1, §6).

``kvfleet router --envoy-xds-port P`` serves, on one gRPC port next to the router's HTTP
port, Envoy's listeners and clusters over ADS (:mod:`.xds`, :mod:`.ads`) and Envoy's
ext_proc calls (:mod:`.extproc`). ext_proc asks a small interface (:mod:`.gate`) for each
decision; :mod:`.router_gate` answers it with the router's own authentication, quotas,
admission queue and picker. :mod:`.server` runs it all with the router app;
:mod:`.process` runs the real Envoy binary from a rendered bootstrap.
"""
