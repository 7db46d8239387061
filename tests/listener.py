"""A real `realm listen` process on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.servers import free_port

# Every listener log of the session, with the secrets its process was given:
# conftest checks at the end of the suite that no log holds any of them.
LOGS: list[tuple[Path, list[str]]] = []
SECRET_ENV_WORDS = ("SECRET", "TOKEN", "PASSWORD", "KEY")


class Listener:
    """Runs `python -m gateway listen` with a config, env and Redis URL of the test's."""

    def __init__(
        self,
        workdir: Path,
        config_text: str,
        *,
        redis_url: str | None,
        env: dict[str, str] | None = None,
        workers: int = 1,
        args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.config_path = workdir / "triggers.yaml"
        self.config_path.write_text(config_text)
        self.redis_url = redis_url
        self.env = env or {}
        self.workers = workers
        self.args = args
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "listen.log"
        secrets = [v for k, v in self.env.items() if any(w in k for w in SECRET_ENV_WORDS)]
        LOGS.append((self.log_path, [v for v in secrets if len(v) >= 6]))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0, port: int | None = None) -> Listener:
        self.port = port or free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
        env.update(self.env)
        cmd = [sys.executable, "-m", "gateway", "listen", "--config", str(self.config_path),
               "--port", str(self.port), "--workers", str(self.workers), *self.args]  # fmt: skip
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            cmd, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"realm listen exited {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"realm listen did not answer in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self) -> None:
        """Send SIGTERM (a graceful shutdown) without waiting."""
        assert self.process
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 40.0) -> int:
        assert self.process
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def run_state_keys(db: Any) -> list[str]:
    """The keys of ``db`` a claim writes: everything but the delivery log, which records
    refused deliveries too (gateway/deliveries/log.py)."""
    return sorted(k for k in db.scan_iter(count=1000) if ":{deliveries:log}:" not in str(k))


def run_state_size(db: Any) -> int:
    return len(run_state_keys(db))


def spool_off(config_text: str) -> str:
    """``config_text`` with ``settings.spool: false``: a delivery Redis cannot take is
    answered 503, as the tests of that answer need (the spool would keep it)."""
    doc = yaml.safe_load(config_text)
    doc.setdefault("settings", {})["spool"] = False
    return yaml.safe_dump(doc, sort_keys=False)
