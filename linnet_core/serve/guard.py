"""Connection limits a public socket needs and uvicorn does not set, on its httptools protocol (what
uvicorn runs when the `serve` extra is installed).

uvicorn arms no timer until a first response, bounds neither the count nor the size of headers on
httptools, and counts every open socket against `limit_concurrency` before the app sees a request:
one client holding idle sockets, sending headers a byte at a time or never finishing a chunked body
could lock every other client out. Here a request's line and headers must arrive within
`header_seconds` of its first byte (a new connection's, of the connect), a body within
`body_seconds` plus its declared size at `body_min_rate`, headers are bounded in count and bytes
(431), and one peer address holds at most `per_peer` connections (503 past it). Each refusal is an
OpenAI-shaped JSON error and closes the connection.
"""

from __future__ import annotations

import http
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's own timer)
REFUSED = "linnet.refused"  # set in a request's scope when the guard ended it: the app's read then logs nothing


@dataclass(frozen=True)
class ConnectionLimits:
    header_seconds: float = 10.0  # the request line and headers, from the request's first byte
    body_seconds: float = 10.0  # a body's allowance before its size is counted
    body_min_rate: int = 64 * 1024  # bytes/s a body must at least average: a 1 MiB body gets 10 + 16 s
    max_header_count: int = 100
    max_header_bytes: int = 64 * 1024  # the request line and every header together
    per_peer: int = 512  # open connections from one address
    retry_after_s: int = 5


def refusal(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    head = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode()), b"content-type: application/json",
            b"content-length: %d" % len(body), b"connection: close"]
    if retry_after_s is not None:
        head.append(b"retry-after: %d" % retry_after_s)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def uvicorn_options(limits: ConnectionLimits, max_body_bytes: int, max_connections: int) -> dict[str, Any]:
    """The uvicorn.run / uvicorn.Config settings of a Linnet server: the guarded protocol, the total
    of open connections past which uvicorn answers 503, and keep-alive."""
    return {"http": guarded_protocol(limits, max_body_bytes), "limit_concurrency": max_connections,
            "timeout_keep_alive": KEEP_ALIVE_S}


def guarded_protocol(limits: ConnectionLimits, max_body_bytes: int) -> type:
    """uvicorn's httptools protocol with `limits` (pass as `uvicorn.run(..., http=...)`); one class per
    server, which counts its own connections per peer."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # needs httptools: imported when serving

    peers: Counter[str] = Counter()

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _peer: str | None = None
        _refused = False
        _in_headers = True
        _header_count = _header_bytes = _unparsed = 0
        _timer = None

        # -- the connection ---------------------------------------------------------------
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._peer = self.client[0] if self.client else ""
            peers[self._peer] += 1
            if peers[self._peer] > limits.per_peer:
                self._refuse(503, f"this address holds {limits.per_peer} open connections, the most one client "
                                  "may; close some or retry later", limits.retry_after_s)
                return
            self._arm(limits.header_seconds, "the request's headers did not arrive in time")

        def connection_lost(self, exc) -> None:
            if self._peer is not None:
                peers[self._peer] -= 1
                if peers[self._peer] <= 0:
                    del peers[self._peer]
                self._peer = None
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._in_headers and not self._refused:  # a header still arriving: count what it holds so far
                self._unparsed += len(data)
                if self._unparsed > limits.max_header_bytes:
                    self._refuse(431, f"the request's headers are over {limits.max_header_bytes} bytes")

        # -- the parser's callbacks -------------------------------------------------------
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers, self._header_count, self._header_bytes, self._unparsed = True, 0, 0, 0
            if self._timer is None:  # a keep-alive connection's next request: its time starts now
                self._arm(limits.header_seconds, "the request's headers did not arrive in time")

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._count(0, len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._refused:
                return
            super().on_header(name, value)
            self._count(1, len(name) + len(value) + 4)

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            self._in_headers = False
            self._disarm()
            size = self._body_size()
            if size:
                self._arm(limits.body_seconds + size / limits.body_min_rate, "the request's body did not arrive in time")
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            self._disarm()
            super().on_message_complete()

        # -- limits -----------------------------------------------------------------------
        def _count(self, headers: int, size: int) -> None:
            self._header_count += headers
            self._header_bytes += size
            if self._header_count > limits.max_header_count:
                self._refuse(431, f"the request has over {limits.max_header_count} headers")
            elif self._header_bytes > limits.max_header_bytes:
                self._refuse(431, f"the request's headers are over {limits.max_header_bytes} bytes")

        def _body_size(self) -> int:
            """The bytes a body will take: its Content-Length, or the body limit for a chunked one."""
            for name, value in self.headers:
                if name == b"content-length" and value.isdigit():
                    return min(int(value), max_body_bytes)
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    return max_body_bytes
            return 0

        def _arm(self, seconds: float, message: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expire, message)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self, message: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete and self.cycle.response_started:
                self._refused = True  # the app is answering: cut it short, it cannot take a second status
                self.transport.close()
                return
            self._refuse(408, message)

        def _refuse(self, status: int, message: str, retry_after_s: int | None = None) -> None:
            """Answer `status` and close; nothing more is read from this connection."""
            if self._refused:
                return
            self._refused = True
            self._disarm()
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.scope[REFUSED] = status
                self.cycle.disconnected = True  # the app's receive() ends: its request is over
                self.cycle.message_event.set()
            if not self.transport.is_closing():
                self.transport.write(refusal(status, message, retry_after_s))
                self.transport.close()

    return GuardedHttpToolsProtocol
