"""A take that runs out of time hands over the steps it already leased: they are the
runner's, and would otherwise wait a whole lease for nobody. Real Redis, behind a
proxy that stops passing one connection's commands on at a chosen command, so the
deadline passes at a known point of the take (no race with a timer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.errors import StoreUnavailable
from gateway.store.keys import Keys
from gateway.store.runstore import RunStore
from tests.servers import RedisServer
from tests.tcp_proxy import parse_command

YAML = """
version: 1
workflows:
  job:
    steps: [fetch, build]
    lease: 30s
"""


class HoldingProxy:
    """Forwards every connection to Redis, byte for byte, until a client sends the
    (``allow`` + 1)-th EVALSHA of the script ``sha``: from then on nothing more that
    connection sends is passed on, as if Redis stopped answering it."""

    def __init__(self, upstream_port: int, sha: str, allow: int) -> None:
        self.upstream_port = upstream_port
        self.sha = sha.encode()
        self.allow = allow
        self.seen = 0
        self.held = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._streams: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def close(self) -> None:
        for writer in self._streams:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._streams += [writer, up_writer]
        back = asyncio.create_task(_pump(up_reader, writer))
        buf = bytearray()
        try:
            while data := await reader.read(65536):
                buf += data
                while buf and not self.held.is_set():
                    parsed = parse_command(buf)
                    if parsed is None:
                        break
                    args, end = parsed
                    if args[:2] == [b"EVALSHA", self.sha] or args[:2] == [b"evalsha", self.sha]:
                        self.seen += 1
                        if self.seen > self.allow:
                            self.held.set()
                            break
                    up_writer.write(bytes(buf[:end]))
                    del buf[:end]
        except (ConnectionError, OSError):
            pass
        finally:
            back.cancel()
            up_writer.close()
            writer.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
    except (ConnectionError, OSError):
        pass


@pytest.fixture
async def direct(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = redis_client(redis_server.url, 5.0)
    await client.flushall()
    yield client
    await client.aclose()


async def test_a_take_out_of_time_returns_the_steps_it_leased(
    direct: Redis, redis_server: RedisServer
) -> None:
    config = parse_config(YAML, file="job.yaml", with_triggers=False)
    starter = RunStore(direct, config, timeout=5.0)
    await starter.ensure_groups("job")
    first = await starter.start_run("job", {"n": 1})
    second = await starter.start_run("job", {"n": 2})

    # The take reads both entries, leases the first (one take_step call) and sends the
    # second take_step, which the proxy never passes on: the deadline passes there.
    proxy = HoldingProxy(redis_server.port, starter.scripts.take_step.sha, allow=1)
    client = redis_client(await proxy.start(), 5.0)
    store = RunStore(client, config, timeout=0.5)
    await store.ensure_groups("job")
    try:
        taken = await store.take_steps("job", "r1", count=2)
        assert proxy.held.is_set(), "the second take_step was held"
        assert [t.run_id for t in taken] == [first.run_id]
        run_key = Keys("realm", "job").run
        assert await direct.hget(run_key(first.run_id), "lease") == taken[0].lease.encode()
        assert await direct.hget(run_key(second.run_id), "lease") is None, "never leased"

        # With nothing leased before the deadline, the take says the store is unavailable.
        await starter.start_run("job", {"n": 3})
        proxy.allow, proxy.seen = 0, 0
        proxy.held.clear()
        with pytest.raises(StoreUnavailable):
            await store.take_steps("job", "r2", count=1)
    finally:
        await client.aclose()
        await proxy.close()
