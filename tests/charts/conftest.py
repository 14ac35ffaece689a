"""The chart tests' one piece of set-up: the generated Envoy types, imported quietly.

The gateway chart test runs the real Envoy against the router's gateway, whose generated
``envoy_data_plane`` modules trip a pydantic deprecation warning at import time (theirs).
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import kvfleet.router.gateway.server  # noqa: F401  (imports every generated module the gateway uses)
