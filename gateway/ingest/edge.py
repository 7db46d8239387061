"""uvicorn's httptools protocol with a cap on a request's head (431).

uvicorn and httptools put no limit on a request line and headers: a sender could
make a worker buffer megabytes of one header value (httptools joins its pieces by
concatenation, quadratic in the number of reads) before the app is even called.
Here the bytes of an unfinished head are counted as they arrive; past
``settings.max_header_bytes`` the request is answered 431 at once, never reaches
the app, and the connection is closed.

uvicorn has no public option for this with httptools (``h11_max_incomplete_event_size``
caps the slower h11 protocol only), so this subclass overrides ``data_received`` and
the parser's ``on_headers_complete``/``on_message_complete`` callbacks, and reads the
protocol's ``app`` and ``transport``: uvicorn internals. pyproject.toml pins uvicorn to
the minor versions this was tested on; tests/test_edge_contract.py fails with a clear
message on one whose internals differ.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.model.config import DEFAULT_MAX_HEADER_BYTES

# After a 431 the rest of what the sender is writing is read and dropped for this
# long before the socket is closed: closing with unread bytes makes the kernel send
# a reset, which most clients report as a broken connection instead of the 431.
LINGER_SECONDS = 2.0


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Counts the bytes of an unfinished head in ``data_received`` (one addition per
    read); only when they pass the limit is the head's end looked for (a C-speed
    ``find``), to tell a head over the limit from a small head followed by its body
    in the same read. No Python work per header: the common request pays nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The limit is the app's setting (gateway/serving/app.py); any other app gets the default.
        settings = getattr(self.app, "settings", None)
        self.max_head: int = getattr(settings, "max_header_bytes", DEFAULT_MAX_HEADER_BYTES)
        self._in_head = True  # bytes received now belong to a request's head
        self._raw_head = 0  # bytes of the current head received so far (and what follows it)
        self._tail = b""  # the last 3 bytes of the head so far: its end may straddle reads
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a 431: drop what the sender is still writing
        if self._in_head:
            before = self._raw_head
            self._raw_head += len(data)
            if self._raw_head > self.max_head:
                # Where does the head end? Past the limit (or nowhere yet): 431.
                end = (self._tail + data).find(b"\r\n\r\n")
                if end < 0 or before - len(self._tail) + end + 4 > self.max_head:
                    self._refuse()
                    return
            else:
                self._tail = (self._tail + data)[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The next request's head starts here (pipelined bytes already read count
        # from the next read on: a bound, not an exact figure, for those rare ones).
        self._in_head, self._raw_head, self._tail = True, 0, b""

    def _refuse(self) -> None:
        self._refused = True
        body = orjson.dumps(
            {
                "status": "error",
                "code": "VALIDATION_HEADERS_TOO_LARGE",
                "message": f"the request line and headers exceed {self.max_head} bytes "
                "(settings.max_header_bytes)",
            }
        )
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body)
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()
