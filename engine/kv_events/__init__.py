"""KV cache events from the engine (vLLM's ``--kv-events-config``): the pool's stores, evictions and
clears, batched per step and published over ZMQ off the step's critical path.

Where it sits: ``engine/cli.py`` builds the engine and calls :func:`attach`; the collector
(:mod:`.collector`) observes the block pool, :mod:`.publisher` sends the batches. The wire
structs are shared with the router: ``kvfleet/kv_events.py``.
"""

from kvfleet.engine.kv_events.collector import KVEventCollector, attach
from kvfleet.engine.kv_events.publisher import ZmqEventPublisher

__all__ = ["KVEventCollector", "ZmqEventPublisher", "attach"]
