"""The core link under a burst: throughput, and how long the API process's event loop is ever held up.

Where it sits: measures ``engine/link.py`` alone (no engine), the link between
``kvfleet engine``'s API process and its core. Part A sends a burst of long-prompt
commands from the event loop (``AsyncLink``) to a peer thread reading as the core does
(``BlockingLink``); part B sends big step batches the other way. Each prints MB/s and the
event loop's worst lag (a 1 ms ticker's largest gap beyond its period). The baseline is the
old transport, ``multiprocessing.Connection`` with blocking sends from the same thread
(which on a non-blocking socket failed with ``BlockingIOError`` instead of waiting).

Run: ``.venv/bin/python -m bench.serving.core_link [--prompts 200 --tokens 6000]``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import threading
import time
from typing import Any

from bench.common import bench_args
from kvfleet.engine.link import AsyncLink, BlockingLink, frame


async def _lag_while(done: asyncio.Event) -> float:
    """The worst extra delay a 1 ms sleep saw on this loop until ``done``."""
    worst, last = 0.0, time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last - 0.001), now
    return worst


async def send_burst(messages: list[Any]) -> tuple[float, float]:
    """Seconds to deliver ``messages`` from the loop to a reading peer, and the loop's worst lag."""
    ours, theirs = socket.socketpair()
    peer, got = BlockingLink(theirs), []
    loop, done = asyncio.get_running_loop(), asyncio.Event()
    link = AsyncLink(BlockingLink(ours), loop, lambda m: None, lambda r: None)

    def read() -> None:
        for _ in messages:
            got.append(peer.recv())
        loop.call_soon_threadsafe(done.set)

    lag = asyncio.ensure_future(_lag_while(done))
    start = time.perf_counter()
    threading.Thread(target=read, daemon=True).start()
    for m in messages:  # one send per request handler, as the server's routes do
        link.send(m)
        await asyncio.sleep(0)
    await done.wait()
    took = time.perf_counter() - start
    link.detach()
    ours.close(), theirs.close()
    assert len(got) == len(messages)
    return took, await lag


async def receive_burst(messages: list[Any]) -> tuple[float, float]:
    """Seconds for the loop to receive ``messages`` from a sending peer, and the loop's worst lag."""
    ours, theirs = socket.socketpair()
    loop, done, got = asyncio.get_running_loop(), asyncio.Event(), []

    def on_message(m: Any) -> None:
        got.append(m)
        if len(got) == len(messages):
            done.set()

    link = AsyncLink(BlockingLink(ours), loop, on_message, lambda r: None)
    lag = asyncio.ensure_future(_lag_while(done))
    start = time.perf_counter()
    peer = BlockingLink(theirs)
    threading.Thread(target=lambda: [peer.send(m) for m in messages], daemon=True).start()
    await done.wait()
    took = time.perf_counter() - start
    link.detach()
    ours.close(), theirs.close()
    return took, await lag


def connection_baseline(messages: list[Any]) -> float:
    """The old transport: ``multiprocessing.Connection`` blocking sends to a reading thread."""
    a, b = multiprocessing.Pipe(duplex=True)
    reader = threading.Thread(target=lambda: [b.recv() for _ in messages], daemon=True)
    start = time.perf_counter()
    reader.start()
    for m in messages:
        a.send(m)
    reader.join()
    return time.perf_counter() - start


def main() -> None:
    args = bench_args(__doc__, prompts=200, tokens=6000, batches=200, seqs_per_batch=256)
    adds = [
        ("add", f"req-{i}", list(range(1000, 1000 + args.tokens)), {"max_tokens": 128})
        for i in range(args.prompts)
    ]
    batches = [
        (time.monotonic(), None, [], [(f"req-{j}", False, 0, 0, [(0, [42], "word", None)]) for j in range(args.seqs_per_batch)], None, None)
        for _ in range(args.batches)
    ]  # fmt: skip
    a_mb = sum(len(frame(m)) for m in adds) / 1e6
    b_mb = sum(len(frame(m)) for m in batches) / 1e6
    a_took, a_lag = asyncio.run(send_burst(adds))
    b_took, b_lag = asyncio.run(receive_burst(batches))
    base = connection_baseline(adds)
    print(f"A. {args.prompts} commands of {args.tokens} token ids ({a_mb:.1f} MB) API -> core:")
    print(
        f"   AsyncLink {a_took * 1e3:.0f} ms ({a_mb / a_took:.0f} MB/s), event loop worst lag {a_lag * 1e3:.1f} ms"
    )
    print(f"   multiprocessing.Connection, blocking (baseline) {base * 1e3:.0f} ms ({a_mb / base:.0f} MB/s)")
    print(f"B. {args.batches} step batches of {args.seqs_per_batch} sequences ({b_mb:.1f} MB) core -> API:")
    print(
        f"   AsyncLink {b_took * 1e3:.0f} ms ({b_mb / b_took:.0f} MB/s), event loop worst lag {b_lag * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
