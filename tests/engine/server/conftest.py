"""A real uvicorn server on 127.0.0.1 serving the real Engine over the simulator (deterministic "abcde..." tokens)."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from kvfleet.engine import cli
from kvfleet.engine.server.app import create_app
from kvfleet.engine.server.state import ServerState
from kvfleet.engine.server.tool_parsers import PARSERS
from kvfleet.engine.testing.tiny import ensure_tiny_model
from kvfleet.testing.faults import children


def engine_args(*flags: str, simulate: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args([*(["--simulate"] if simulate else []), "--host", "127.0.0.1", *flags])


# A small, instant engine: 64 blocks of 16 tokens, a 256-token context, steps cost nothing.
FAST = ("--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8", "--sim-base-ms", "0",
        "--sim-per-token-ms", "0", "--sim-per-context-token-us", "0")  # fmt: skip
# Steps of 20 ms: streams stay open long enough to disconnect or drain mid-way.
SLOW = (*FAST[:8], "--sim-base-ms", "20", "--sim-per-token-ms", "0", "--sim-per-context-token-us", "0")


@dataclass
class LiveServer:
    url: str
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10)

    def openai_client(self) -> openai.OpenAI:
        """The official ``openai`` client on this server (no retries: a test sees every refusal)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def wait_until(self, predicate: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
        deadline = time.monotonic() + limit_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def load(self) -> dict[str, object]:
        with self.client() as c:
            data: dict[str, object] = c.get("/load").json()
            return data


def start_server(*flags: str, simulate: bool = True) -> LiveServer:
    state = cli.build_server_state(engine_args(*flags, simulate=simulate))
    config = uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(f"http://127.0.0.1:{port}", state, server, thread)


def stop_server(live: LiveServer) -> None:
    live.server.should_exit = True
    live.thread.join(10)


def _serve(*args: str, simulate: bool = True) -> Iterator[LiveServer]:
    """A fixture's server: started, yielded, stopped even when the test failed."""
    live = start_server(*args, simulate=simulate)
    try:
        yield live
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def fast_server() -> Iterator[LiveServer]:
    yield from _serve(*FAST)


@pytest.fixture
def client(fast_server: LiveServer) -> Iterator[openai.OpenAI]:
    """The ``openai`` client on :func:`fast_server` (a module that speaks another API overrides it)."""
    with fast_server.openai_client() as c:
        yield c


@pytest.fixture
def slow_server() -> Iterator[LiveServer]:
    yield from _serve(*SLOW)


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[LiveServer]:
    """The real tiny model (torch, CPU) behind the server."""
    yield from _serve(
        "--model",
        "tiny",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        simulate=False,
    )


@pytest.fixture(scope="module")
def long_tiny_server() -> Iterator[LiveServer]:
    """The real tiny model with room for a tools prompt (its byte tokenizer makes one 700 tokens)."""
    yield from _serve("--model", "tiny", "--num-kv-blocks", "256", "--max-model-len", "2048",
                      "--max-num-seqs", "2", simulate=False)  # fmt: skip


@pytest.fixture(scope="module", params=sorted(PARSERS))
def auto_tool_server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """The real tiny model serving ``tool_choice: auto`` with each registered parser in turn."""
    yield from _serve("--model", "tiny", "--num-kv-blocks", "256", "--max-model-len", "2048",
                      "--max-num-seqs", "2", "--enable-auto-tool-choice", "--tool-call-parser",
                      request.param, simulate=False)  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[LiveServer]:
    """Real SmolLM2-135M-Instruct (torch, CPU) behind the server."""
    yield from _serve(
        "--model", "smollm2", "--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "4",
        simulate=False,
    )  # fmt: skip


# Reasoning models on copies of the tiny checkpoint (tests/engine/server/test_reasoning_served.py): a
# Qwen3-style template that honours enable_thinking, and a gpt-oss one whose tokenizer has no template.
QWEN3_TEMPLATE = (
    r"{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    r"{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    r"{% endif %}"
)
REASONING_SIZE = ("--num-kv-blocks", "256", "--max-model-len", "2048", "--max-num-seqs", "2")


def _model_copy(root: Path, name: str, template: str | None) -> Path:
    folder = root / name
    shutil.copytree(ensure_tiny_model(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = _model_copy(tmp_path_factory.mktemp("qwen3"), "qwen3-tiny", QWEN3_TEMPLATE)
    yield from _serve("--model", str(folder), "--served-model-name", "qwen3-tiny", "--reasoning-parser", "qwen3",
                      *REASONING_SIZE, simulate=False)  # fmt: skip


@pytest.fixture(scope="module")
def gptoss_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = _model_copy(tmp_path_factory.mktemp("gptoss"), "gpt-oss-tiny", None)
    yield from _serve("--model", str(folder), "--served-model-name", "gpt-oss-tiny", "--reasoning-parser",
                      "openai_gptoss", "--tool-call-parser",
                      "openai", "--enable-auto-tool-choice", *REASONING_SIZE, simulate=False)  # fmt: skip


EMBED_MODEL = "tiny-embed"  # the pooling server's model: the tiny decoder, told it is matryoshka-trained


@pytest.fixture(scope="module")
def embed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model's folder whose config.json says ``is_matryoshka`` (``dimensions`` allowed)."""
    target = tmp_path_factory.mktemp("embed") / EMBED_MODEL
    shutil.copytree(ensure_tiny_model(), target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return target


@pytest.fixture(scope="module")
def pooling_server(embed_folder: Path) -> Iterator[LiveServer]:
    """The tiny model served for embeddings (``--runner pooling``): torch, CPU."""
    yield from _serve(
        "--model", str(embed_folder), "--served-model-name", EMBED_MODEL, "--runner", "pooling",
        "--max-model-len", "256", "--max-num-batched-tokens", "512", simulate=False,
    )  # fmt: skip


@pytest.fixture
def own_fast_server() -> Iterator[LiveServer]:
    """A fast server of the test's own, for a test that breaks it."""
    yield from _serve(*FAST)


@pytest.fixture
def thread_server() -> Iterator[LiveServer]:
    """The engine core in a thread of the server (``--engine-core thread``)."""
    yield from _serve("--engine-core", "thread", *FAST)


class Procs:
    """What /proc says about processes (the engine core is a child of the server process)."""

    @staticmethod
    def children_of(pid: int) -> list[int]:
        """Live (non-zombie) processes whose parent is ``pid``."""
        return children(pid)

    @staticmethod
    def is_gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    @staticmethod
    def wait_gone(pids: list[int], limit_s: float = 20.0) -> None:
        deadline = time.monotonic() + limit_s
        while not all(Procs.is_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"processes {pids} still alive after {limit_s} s"
            time.sleep(0.05)


@pytest.fixture
def procs() -> Procs:
    return Procs()
