"""The API-process side of the engine: the core client, asyncio request streams, and the offline ``LLM``.

Where it sits: the HTTP server (``engine/server/``) and ``LLM.generate`` call in here; requests cross to
the engine core (``engine/core/``) in-thread or over the core link; nothing here imports torch.
"""
