"""uvicorn's httptools protocol with a cap on a request's head (431).

uvicorn and httptools put no limit on a request line and headers: a sender could
make a worker buffer megabytes of one header value (httptools joins its pieces by
concatenation, quadratic in the number of reads) before the app is even called.
Here the bytes of an unfinished head are counted as they arrive; past
``settings.max_header_bytes`` the request is answered 431 at once, never reaches
the app, and the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import DEFAULT_MAX_HEADER_BYTES

# After a 431 the rest of what the sender is writing is read and dropped for this
# long before the socket is closed: closing with unread bytes makes the kernel send
# a reset, which most clients report as a broken connection instead of the 431.
LINGER_SECONDS = 2.0


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over the limit."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The limit is the app's setting (gateway/app.py); any other app gets the default.
        settings = getattr(self.app, "settings", None)
        self.max_head: int = getattr(settings, "max_header_bytes", DEFAULT_MAX_HEADER_BYTES)
        self._in_head = True  # bytes received now belong to a request's head
        self._raw_head = 0  # bytes received while in a head (an upper bound of its size)
        self._parsed_head = 0  # request line and headers parsed so far
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a 431: drop what the sender is still writing
        if self._in_head:
            self._raw_head += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._parsed_head > self.max_head:
                self._refuse()
                return
            message = "Invalid HTTP request received."
            self.logger.warning(message)
            self.send_400_response(message)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        # A head still unfinished after this many bytes is over the limit whatever
        # comes next. (A head that finished in this read was counted exactly, below.)
        if self._in_head and self._raw_head > self.max_head:
            self._refuse()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_head = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url) + 16)  # with the method and version around it
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._raw_head = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True

    def _count(self, n: int) -> None:
        self._parsed_head += n
        if self._parsed_head > self.max_head:
            raise HeadTooLarge

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
