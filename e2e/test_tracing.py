"""One streamed request through `kvfleet up` with tracing on: one trace, router and engine spans, parented right.

The OTLP receiver is a real HTTP endpoint in the test (:mod:`kvfleet.testing.otlp_receiver`)
decoding what the SDK's exporters send; the fleet is `kvfleet up` with one simulated engine,
configured by the standard ``OTEL_*`` variables only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from kvfleet.router.local import LOCAL_API_KEY
from kvfleet.testing.otlp_receiver import OtlpReceiver
from kvfleet.testing.processes import free_port

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
ROUTER_STEPS = {"authenticate", "quota", "admission_queue", "engine_pick", "proxy"}
ENGINE_STEPS = {"engine.request", "engine.queue", "engine.prefill", "engine.decode"}
TOLERANCE_S = 0.05  # the client's clock readings against the spans' (one host, one wall clock)


def _until_served(url: str, process: subprocess.Popen[bytes]) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    for _ in range(600):
        assert process.poll() is None, "kvfleet up exited early"
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, headers=_auth(), timeout=10)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the fleet never served")


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {LOCAL_API_KEY}"}


def _stream(url: str) -> tuple[float, float, float]:
    """One streamed chat request continuing the client's trace: (sent, first content chunk, end) in epoch s."""
    headers = {**_auth(), "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 12,
            "stream": True, "ignore_eos": True}  # fmt: skip
    first = None
    with httpx.Client(
        timeout=30
    ) as client:  # made first: httpx builds an SSL context per client (tens of ms)
        sent = time.time()
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else None
                if first is None and choices and choices[0]["delta"].get("content"):
                    first = time.time()
        end = time.time()
    assert first is not None
    return sent, first, end


def test_a_streamed_request_through_kvfleet_up_is_one_trace_of_router_and_engine_spans() -> None:
    port = free_port()
    with OtlpReceiver() as receiver:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
        argv = [
            sys.executable,
            "-m",
            "kvfleet.cli",
            "up",
            "--replicas",
            "1",
            "--simulate",
            "--port",
            str(port),
        ]
        process = subprocess.Popen(argv, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _until_served(url, process)
            sent, first, end = _stream(url)
            spans = receiver.wait_for(
                CLIENT_TRACE, ROUTER_STEPS | ENGINE_STEPS | {"POST /v1/chat/completions"}
            )
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    root = spans.pop("POST /v1/chat/completions")
    assert spans.keys() >= ROUTER_STEPS | ENGINE_STEPS, sorted(spans)
    assert root.parent_span_id == CLIENT_SPAN and root.service == "kvfleet-router"
    for name in ROUTER_STEPS:
        assert spans[name].parent_span_id == root.span_id and spans[name].service == "kvfleet-router"
    engine = spans["engine.request"]
    assert engine.service == "kvfleet-engine" and engine.parent_span_id == spans["proxy"].span_id
    for name in ENGINE_STEPS - {"engine.request"}:
        assert spans[name].parent_span_id == engine.span_id
    for span in (root, engine):
        assert span.attributes["gen_ai.request.model"] == "tiny"
        assert span.attributes["gen_ai.usage.output_tokens"] == 12
        assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
        assert span.attributes["gen_ai.request.max_tokens"] == 12
    assert root.attributes["kvfleet.tenant"] and root.attributes["kvfleet.engine"]
    # What the client measured, against the spans: TTFT (its request sent → first content chunk),
    # and the queue wait, which it cannot see alone: the router's and the engine's queue spans fit in it.
    client_ttft = first - sent
    span_ttft = (engine.events["first_token"] - root.start_ns) / 1e9  # the engine's, from the router's start
    router_ttft = (root.events["first_token"] - root.start_ns) / 1e9  # the router's, sent on to the client
    queued = spans["admission_queue"].duration_s + spans["engine.queue"].duration_s
    print(f"TTFT: client {client_ttft * 1000:.1f} ms, router span {router_ttft * 1000:.1f} ms, engine span "
          f"{span_ttft * 1000:.1f} ms; queued {queued * 1000:.2f} ms; e2e {(end - sent) * 1000:.1f} ms", file=sys.stderr)  # fmt: skip
    assert abs(client_ttft - router_ttft) <= TOLERANCE_S
    assert abs(client_ttft - span_ttft) <= TOLERANCE_S
    assert queued <= client_ttft + TOLERANCE_S
    assert abs(root.start_ns / 1e9 - sent) <= TOLERANCE_S and abs(root.end_ns / 1e9 - end) <= TOLERANCE_S
