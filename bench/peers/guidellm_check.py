"""guidellm (0.8.1, an independent client) against kvfleet's engine and against ``kvfleet up``: zero errors.

    python -m bench.peers.guidellm_check [--model tiny|smollm2|FOLDER] [--targets engine,up] [--max-requests 10]
    python -m bench.peers.guidellm_check --url http://host:port [--api-key K] --tokenizer FOLDER   # any server

Per target it runs one bounded ``guidellm run`` (``--profile kind=synchronous`` then
``kind=concurrent,streams=4``, ``--constraint kind=max_requests``, synthetic chat prompts of
``--prompt-tokens`` and outputs of ``--output-tokens``, the model folder's tokenizer), reads
its JSON report and fails unless every request of every benchmark succeeded (none
errored, none incomplete). guidellm lives in its own venv (``bench/peers/guidellm_env.sh``
creates it: its dependencies would upgrade packages of kvfleet's ``.venv``). Targets:
``engine`` is ``kvfleet engine --model M``; ``up`` is ``kvfleet up --model M`` (the router
in front of ``--replicas`` engines, with its local tenant's API key). Every process is
started here and stopped at the end, and every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.common import resolve_model, side_venv
from kvfleet.testing.processes import engine_process, free_port, kvfleet_argv, stop, wait_http

LOCAL_API_KEY = "sk-kvfleet-local"  # kvfleet up's one local tenant (kvfleet.router.local)
PROFILES = ("kind=synchronous", "kind=concurrent,streams=4")


def guidellm_bin() -> str:
    return side_venv("guidellm_env.sh", 1200)


def model_folder(model: str) -> Path:
    """The folder holding the model's tokenizer (tiny: its cache folder, built on first use)."""
    if model == "tiny":
        from kvfleet.engine.testing.tiny import ensure_tiny_model

        return Path(ensure_tiny_model())
    return resolve_model(model)


def run_guidellm(
    guidellm: str,
    url: str,
    tokenizer: Path,
    *,
    profile: str,
    api_key: str | None,
    max_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    timeout_s: float,
) -> dict[str, int]:
    """One ``guidellm run``; the successful / errored / incomplete request counts of its JSON report."""
    backend = f"kind=openai_http,target={url}" + (f",api_key={api_key}" if api_key else "")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "benchmarks.json"
        argv = [guidellm, "run", "--backend", backend, "--profile", profile,
                "--constraint", f"kind=max_requests,count={max_requests}",
                "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
                "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                "--output", f"kind=json,path={report}", "--disable-console-interactive"]  # fmt: skip
        proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(
                f"guidellm exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
            )
        data = json.loads(report.read_text())
    counts = {"benchmarks": len(data["benchmarks"]), "successful": 0, "errored": 0, "incomplete": 0}
    for bench in data["benchmarks"]:
        totals = bench["metrics"]["request_totals"]
        for key in ("successful", "errored", "incomplete"):
            counts[key] += int(totals[key] or 0)
    return counts


@contextlib.contextmanager
def kvfleet_up(model: str, replicas: int, timeout_s: float) -> Iterator[str]:
    """``kvfleet up`` on a free port; yields the router's URL once it sees every engine ready."""
    port = free_port()
    argv = kvfleet_argv("up", "--model", model, "--replicas", str(replicas), "--port", str(port))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                if sum(httpx.get(url + "/ready", timeout=2).json()["ready_engines"].values()) >= replicas:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvfleet up did not get {replicas} ready engine(s) in {timeout_s}s")
            time.sleep(0.2)
        yield url
    finally:
        stop([proc])  # kvfleet up drains and stops its engines on SIGTERM


@contextlib.contextmanager
def target(name: str, model: str, args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """(base URL, API key) of a started target."""
    if name == "engine":
        with engine_process("--model", model, ready_timeout_s=args.start_timeout) as (url, _):
            yield url, None
    elif name == "up":
        with kvfleet_up(model, args.replicas, args.start_timeout) as url:
            yield url, LOCAL_API_KEY
    else:
        raise SystemExit(f"unknown target {name!r}: engine or up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a folder (served and tokenizer)")
    p.add_argument("--targets", default="engine,up")
    p.add_argument("--url", help="check this running server instead (needs --tokenizer)")
    p.add_argument("--api-key")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder for --url")
    p.add_argument("--replicas", type=int, default=2, help="kvfleet up's engines")
    p.add_argument("--max-requests", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one guidellm run")
    p.add_argument(
        "--threads",
        default="1",
        help="OMP_NUM_THREADS of the engines started here ('default': unset); on a busy 2-core machine torch's "
        "two spinning threads made a smollm2 run miss its 300 s bound",
    )
    args = p.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)
    if args.threads != "default":
        os.environ["OMP_NUM_THREADS"] = (
            args.threads
        )  # inherited by kvfleet engine / kvfleet up and its engines
    guidellm = guidellm_bin()
    failures = 0

    def check(label: str, url: str, key: str | None, tokenizer: Path) -> None:
        nonlocal failures
        for profile in PROFILES:
            start = time.monotonic()
            counts = run_guidellm(guidellm, url, tokenizer, profile=profile, api_key=key,
                                  max_requests=args.max_requests, prompt_tokens=args.prompt_tokens,
                                  output_tokens=args.output_tokens, timeout_s=args.timeout)  # fmt: skip
            ok = counts["successful"] == args.max_requests * counts["benchmarks"] and not (
                counts["errored"] or counts["incomplete"]
            )
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} guidellm {profile} -> {label}: {counts['successful']} successful, "
                  f"{counts['errored']} errored, {counts['incomplete']} incomplete "
                  f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip

    if args.url:
        if args.tokenizer is None:
            raise SystemExit("--url needs --tokenizer")
        check(args.url, args.url, args.api_key, args.tokenizer)
    else:
        folder = model_folder(args.model)
        served = args.model if args.model == "tiny" else str(folder)
        for name in args.targets.split(","):
            with target(name, served, args) as (url, key):
                check(f"kvfleet {name} --model {args.model}", url, key, folder)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
