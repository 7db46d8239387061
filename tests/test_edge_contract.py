"""gateway/ingest/edge.py subclasses uvicorn's httptools protocol and relies on its
internals (``data_received`` feeding the parser, the parser's ``on_headers_complete``
and ``on_message_complete`` callbacks, the protocol's ``app`` and ``transport``).
pyproject.toml pins uvicorn to the minor versions this was tested on; this test runs
the protocol in a real uvicorn server and fails with a message saying so when a
uvicorn's internals differ, before any listener test would fail obscurely.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.supervisors import Multiprocess

from gateway.ingest.edge import BoundedHttpToolsProtocol
from gateway.model.config import DEFAULT_MAX_HEADER_BYTES
from tests.servers import free_port

WHY = (
    f"gateway/ingest/edge.py and gateway/serving/workers.py rely on uvicorn internals "
    f"(HttpToolsProtocol, Multiprocess), and uvicorn {uvicorn.__version__} differs from the "
    "versions pinned in pyproject.toml: read its source, adapt those modules, then widen "
    "the pin"
)


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        hello, host="127.0.0.1", port=port, http=BoundedHttpToolsProtocol, lifespan="off",
        log_level="warning", proxy_headers=False,
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        thread.join(0.01)
    assert server.started, "uvicorn did not start"
    yield port
    server.should_exit = True
    thread.join(10)


def exchange(port: int, *requests: bytes, until: bytes, times: int = 1) -> bytes:
    """Send ``requests`` on one connection; what the server answered, up to ``until``
    ``times`` times (or until it closed the connection, or went quiet for a second)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for request in requests:
            sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(1.0)
        out = b""
        try:
            while out.count(until) < times and (chunk := sock.recv(65536)):
                out += chunk
        except TimeoutError:
            pass
    return out


def test_the_edge_overrides_what_uvicorn_still_has() -> None:
    for name in ("data_received", "on_headers_complete", "on_message_complete"):
        assert callable(getattr(HttpToolsProtocol, name, None)), f"{WHY} (no {name})"


def test_the_supervisor_overrides_what_uvicorn_still_has() -> None:
    """gateway/serving/workers.py's Supervisor extends uvicorn's Multiprocess."""
    for name in ("handle_hup", "handle_signals", "init_processes", "keep_subprocess_alive",
                 "handle_ttin"):  # fmt: skip
        assert callable(getattr(Multiprocess, name, None)), f"{WHY} (no Multiprocess.{name})"
    config = uvicorn.Config(hello, workers=2)
    assert isinstance(Multiprocess(config, []).signal_queue, list), f"{WHY} (signal_queue)"


def test_kept_alive_requests_pass_through_the_edge(port: int) -> None:
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    answered = exchange(port, request, request, until=b"hello", times=2)
    assert answered.count(b"HTTP/1.1 200 OK") == 2, f"{WHY}: {answered[:300]!r}"
    assert answered.count(b"hello") == 2, WHY


def test_a_head_over_the_cap_is_431(port: int) -> None:
    big = b"x" * (DEFAULT_MAX_HEADER_BYTES + 1024)
    head = b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + big + b"\r\n\r\n"
    answered = exchange(port, head, until=b"}")
    assert answered.startswith(b"HTTP/1.1 431 "), f"{WHY}: {answered[:300]!r}"
    assert b"VALIDATION_HEADERS_TOO_LARGE" in answered
