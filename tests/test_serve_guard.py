"""The connection guard (serve/guard.py) on uvicorn's httptools protocol, with short limits: slow and
idle connections time out, headers are bounded (431), a body must keep arriving, and one address
cannot take every connection. A plain ASGI app stands in for Linnet's: the guard sits below it."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("httptools")
pytest.importorskip("uvicorn")

from linnet_core.serve.guard import ConnectionLimits, uvicorn_options  # noqa: E402
from server_fixtures import app_in_thread  # noqa: E402

LIMITS = ConnectionLimits(header_seconds=1.0, body_seconds=1.0, body_min_rate=1 << 20, max_header_count=50,
                          max_header_bytes=16 * 1024, per_peer=4)
MAX_BODY = 1 << 20  # a chunked body's deadline: 1 s + 1 MiB at 1 MiB/s


async def echo(scope, receive, send):
    """200 with the body's length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    with app_in_thread(echo, **uvicorn_options(LIMITS, MAX_BODY, max_connections=64)) as url:
        yield int(url.rsplit(":", 1)[1])


def connect(port, source="127.0.0.1"):
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return s


def answer(s) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def request(body: bytes = b"", extra: bytes = b"") -> bytes:
    return b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


def test_a_plain_request_and_a_large_body_pass(port):
    with connect(port) as s:
        s.sendall(request(b"x" * 700_000))  # headers and much body in one read: not counted as header bytes
        assert s.recv(4096).split(b"\r\n\r\n")[-1] == b"700000"
        s.sendall(request(b"abc"))  # the same connection again (keep-alive)
        assert s.recv(4096).endswith(b"\r\n\r\n3")


def test_an_idle_connection_is_closed_after_the_header_time(port):
    started = time.monotonic()
    with connect(port) as s:
        got = answer(s)
    assert got.startswith(b"HTTP/1.1 408") and b"did not arrive in time" in got
    assert 0.8 < time.monotonic() - started < 3


def test_headers_sent_a_byte_at_a_time_time_out(port):
    started = time.monotonic()
    with connect(port) as s:
        for byte in request(b"abc")[:40]:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
        got = answer(s)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert time.monotonic() - started < 3


def test_an_unfinished_chunked_body_times_out(port):
    started = time.monotonic()
    with connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        got = answer(s)
    assert got.startswith(b"HTTP/1.1 408") and b"body" in got
    assert 1.5 < time.monotonic() - started < 4  # 1 s + 1 MiB at 1 MiB/s


@pytest.mark.parametrize("extra", [b"".join(b"X-%d: y\r\n" % i for i in range(10_000)),
                                   b"X-Big: " + b"a" * (4 << 20) + b"\r\n"])
def test_header_floods_get_431_at_once(port, extra):
    started = time.monotonic()
    with connect(port) as s:
        try:
            s.sendall(request(b"abc", extra))
        except OSError:  # the server answered and closed before taking it all
            pass
        got = answer(s)
    assert got.startswith(b"HTTP/1.1 431"), got[:200]
    assert time.monotonic() - started < 2


def test_one_address_cannot_take_every_connection(port):
    held = [connect(port, "127.0.0.2") for _ in range(LIMITS.per_peer)]
    try:
        with connect(port, "127.0.0.2") as extra:
            got = answer(extra)
        assert got.startswith(b"HTTP/1.1 503") and b"retry-after: 5" in got.lower()
        with connect(port) as s:  # another address is served meanwhile
            s.sendall(request(b"hi"))
            assert s.recv(4096).endswith(b"\r\n\r\n2")
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    with connect(port, "127.0.0.2") as s:  # closed ones free their slots
        s.sendall(request(b"hi"))
        assert s.recv(4096).endswith(b"\r\n\r\n2")
