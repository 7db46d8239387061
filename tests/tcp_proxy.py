"""A small TCP proxy between the gateway and Redis that can lose one reply on purpose.

It listens on a free loopback port and forwards every connection to Redis,
both ways, byte for byte. It also parses the RESP traffic it forwards (the
commands one way, the replies the other), so it can pair each reply with its
command. When armed with ``drop_next_reply(b"EVALSHA")``, the next EVALSHA it
forwards still reaches Redis and runs there, but its reply is never passed on:
once Redis has answered it (so the script did commit), the proxy closes that
client connection instead, as a network that fails after the write would.

``hold_processes(pids)`` makes the connections of those processes stall (their
commands wait in the proxy) until ``release()``, while other processes' pass.

It runs its own event loop in a thread, so it serves the gateway while the
test blocks (starting the listener, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

_SIMPLE = frozenset(b"+-:_,#(")  # one line
_BULK = frozenset(b"$!=")  # a length line, then that many bytes and CRLF
_AGGREGATE = frozenset(b"*~>")  # a count, then that many values
_PAIRS = frozenset(b"%|")  # a count, then twice that many values


def resp_end(buf: bytes | bytearray, pos: int = 0) -> int | None:
    """Where the RESP2/RESP3 value starting at ``pos`` ends; None if incomplete."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind = buf[pos]
    after = line_end + 2
    if kind in _SIMPLE:
        return after
    n = int(buf[pos + 1 : line_end])
    if kind in _BULK:
        if n < 0:
            return after
        end = after + n + 2
        return end if len(buf) >= end else None
    if kind in _AGGREGATE or kind in _PAIRS:
        count = max(n, 0) * (2 if kind in _PAIRS else 1)
        for _ in range(count):
            found = resp_end(buf, after)
            if found is None:
                return None
            after = found
        if kind == ord("|"):  # attributes precede the value they describe
            return resp_end(buf, after)
        return after
    raise ValueError(f"not RESP: {bytes(buf[pos : pos + 20])!r}")


def parse_command(buf: bytes | bytearray, pos: int = 0) -> tuple[list[bytes], int] | None:
    """One client command (an array of bulk strings, or an inline line) and where it ends."""
    if buf[pos] != ord("*"):
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        return bytes(buf[pos:line_end]).split(), line_end + 2
    end = resp_end(buf, pos)
    if end is None:
        return None
    line_end = buf.find(b"\r\n", pos)
    args: list[bytes] = []
    at = line_end + 2
    for _ in range(int(buf[pos + 1 : line_end])):
        length_end = buf.find(b"\r\n", at)
        n = int(buf[at + 1 : length_end])
        args.append(bytes(buf[length_end + 2 : length_end + 2 + n]))
        at = length_end + 2 + n + 2
    return args, end


@dataclass
class Dropped:
    """A command whose reply the proxy withheld; ``reply`` is what Redis answered."""

    command: list[bytes]
    reply: bytes

    @property
    def script_argv(self) -> list[bytes]:
        """ARGV of an EVAL/EVALSHA: after the script, numkeys and the keys."""
        numkeys = int(self.command[2])
        return self.command[3 + numkeys :]


@dataclass
class _Pending:
    command: list[bytes]
    doomed: bool = False
    stall: bool = False


@dataclass
class TcpProxy:
    upstream_port: int
    host: str = "127.0.0.1"
    port: int = 0
    connections: int = 0
    commands: int = 0
    dropped: list[Dropped] = field(default_factory=list)
    _armed: bytes | None = None
    _armed_sha: bytes | None = None
    _stall: bool = False
    _skip: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # The processes whose connections are held (hold_processes).
    _held_pids: frozenset[int] = frozenset()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> TcpProxy:
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, self.host, 0)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="tcp-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10) or failed:
            raise RuntimeError(f"the proxy did not start: {failed}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._thread = None

    def drop_next_reply(
        self,
        command: bytes = b"EVALSHA",
        sha: bytes | None = None,
        *,
        stall: bool = False,
        after: int = 0,
    ) -> None:
        """Arm: withhold the reply to the next ``command`` forwarded (with ``sha``, the
        next EVALSHA of that script only: a listener's background sweep calls scripts
        too), then cut that client; ``stall``: keep it open and silent instead, a
        connection that stops answering; ``after``: let that many such commands
        through first."""
        with self._lock:
            self._armed = command.upper()
            self._armed_sha = sha
            self._stall = stall
            self._skip = after

    def hold_processes(self, pids: set[int]) -> None:
        """Stop forwarding the commands of every connection of these processes, open now
        or made later (they wait, and their clients time out), until release(); other
        processes' connections pass. Linux: the client's pid is read from /proc."""
        with self._lock:
            self._held_pids = frozenset(pids)

    def release(self) -> None:
        with self._lock:
            self._held_pids = frozenset()

    def _held(self) -> frozenset[int]:
        with self._lock:
            return self._held_pids

    @property
    def armed(self) -> bool:
        with self._lock:
            return self._armed is not None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                redis_r, redis_w = await asyncio.open_connection(self.host, self.upstream_port)
            except OSError:
                client_w.close()
                return
            self.connections += 1
            pending: deque[_Pending] = deque()
            client_port = client_w.get_extra_info("peername")[1]
            up = asyncio.ensure_future(self._requests(client_r, redis_w, pending, client_port))
            down = asyncio.ensure_future(self._replies(redis_r, client_w, pending))
            try:
                await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in (up, down):
                    pump.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
                for writer in (client_w, redis_w):
                    writer.transport.abort()
        finally:
            self._tasks.discard(task)

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
        pending: deque[_Pending],
        client_port: int,
    ) -> None:
        buf = bytearray()
        client_pid: int | None = None
        while chunk := await reader.read(65536):
            buf += chunk
            at = 0
            while at < len(buf) and (parsed := parse_command(buf, at)) is not None:
                args, at = parsed
                self.commands += 1
                entry = _Pending(args)
                name = args[0].upper() if args else b""
                with self._lock:
                    if (
                        self._armed is not None
                        and name == self._armed
                        and (self._armed_sha is None or args[1:2] == [self._armed_sha])
                    ):
                        if self._skip:
                            self._skip -= 1
                        else:
                            entry.doomed, entry.stall, self._armed = True, self._stall, None
                pending.append(entry)
            del buf[:at]
            while held := self._held():
                if client_pid is None:
                    client_pid = _pid_of_connection(client_port, self.port)
                if client_pid not in held:
                    break
                await asyncio.sleep(0.01)
            redis_w.write(chunk)  # registered before it can be answered
            await redis_w.drain()

    async def _replies(
        self, reader: asyncio.StreamReader, client_w: asyncio.StreamWriter, pending: deque[_Pending]
    ) -> None:
        buf = bytearray()
        while chunk := await reader.read(65536):
            buf += chunk
            at = 0
            out = bytearray()
            while at < len(buf) and (end := resp_end(buf, at)) is not None:
                reply = bytes(buf[at:end])
                at = end
                entry = pending.popleft() if pending else _Pending([])
                if entry.doomed:
                    # Redis ran it and answered; the client never hears of it.
                    self.dropped.append(Dropped(entry.command, reply))
                    if out:
                        client_w.write(bytes(out))
                        await client_w.drain()
                    if entry.stall:  # nothing more reaches the client on this connection
                        await asyncio.Event().wait()
                    return
                out += reply
            del buf[:at]
            if out:
                client_w.write(bytes(out))
                await client_w.drain()


def _pid_of_connection(client_port: int, server_port: int) -> int:
    """The process holding the client end (``client_port``) of a loopback connection
    to ``server_port``, from /proc; 0 if not found."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]
            if int(local, 16) == client_port and int(remote, 16) == server_port:
                inode = f"socket:[{fields[9]}]"
    if inode is None:
        return 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) == inode for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
    return 0
