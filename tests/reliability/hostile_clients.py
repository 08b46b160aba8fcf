"""Hostile HTTP clients on raw sockets, against a live server: used by the hostile-client test and
benchmarks/reliability/hostile.py. Each returns what it measured; none waits without a bound."""

import select
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx


def address(base_url: str) -> tuple[str, int]:
    url = urlparse(base_url)
    return url.hostname or "127.0.0.1", url.port or 80


def connect(base_url: str, timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection(address(base_url), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@dataclass
class Held:
    seconds: float
    """From the last byte of the part of the request sent until the server closed (or the bound)."""
    closed: bool
    response: bytes


def held_until_closed(sock: socket.socket, bound_s: float, trickle: bytes = b"") -> Held:
    """Wait for the server to close `sock` (recv → b"" or a reset), sending `trickle` every second
    (a slowloris keeps its request incomplete with one more byte now and then)."""
    start = time.monotonic()
    received = b""
    sock.settimeout(1.0)
    while time.monotonic() - start < bound_s:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if trickle:
                try:
                    sock.sendall(trickle)
                except OSError:
                    return Held(time.monotonic() - start, True, received)
            continue
        except OSError:
            return Held(time.monotonic() - start, True, received)
        if not data:
            return Held(time.monotonic() - start, True, received)
        received += data
    return Held(time.monotonic() - start, False, received)


def slowloris_headers(base_url: str, bound_s: float) -> Held:
    """Headers that never end: a request line and one header, then one header byte a second."""
    sock = connect(base_url)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        return held_until_closed(sock, bound_s, trickle=b"a")
    finally:
        sock.close()


def slowloris_body(base_url: str, api_key: str, bound_s: float) -> Held:
    """Complete headers announcing 1,000 bytes, then 10 bytes and a stall."""
    sock = connect(base_url)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {api_key}\r\n".encode()
            + b"Content-Length: 1000\r\n\r\n" + b'{"model": '
        )
        return held_until_closed(sock, bound_s)
    finally:
        sock.close()


def idle_connections(base_url: str, count: int) -> list[socket.socket]:
    """`count` connections that send nothing."""
    return [connect(base_url) for _ in range(count)]


def closed_within(socks: list[socket.socket], bound_s: float) -> int:
    """How many of `socks` the server closed within bound_s (all are closed here afterwards)."""
    deadline = time.monotonic() + bound_s
    closed = 0
    for sock in socks:
        held = held_until_closed(sock, max(0.1, deadline - time.monotonic()))
        closed += held.closed
        sock.close()
    return closed


def oversized_chunked_body(base_url: str, api_key: str, max_body_bytes: int) -> tuple[int, int]:
    """(status, bytes sent before the answer) of a chunked body that never ends: 4 KiB chunks, one
    every 10 ms, until the server answers or 4 x max_body_bytes went out."""
    sock = connect(base_url)
    sent = 0
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {api_key}\r\n".encode()
            + b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 4096
        answered = False
        while sent < 4 * max_body_bytes and not answered:
            try:
                sock.sendall(b"1000\r\n" + chunk + b"\r\n")
            except OSError:  # the server closed after answering
                break
            sent += len(chunk)
            answered = bool(select.select([sock], [], [], 0.01)[0])
        sock.settimeout(10.0)
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
        return status, sent
    finally:
        sock.close()


def abort_mid_stream(base_url: str, api_key: str, model: str) -> bool:
    """Start a long streamed completion, read its first event, drop the connection. True if an
    event had arrived."""
    sock = connect(base_url, timeout_s=30)
    body = (f'{{"model": "{model}", "prompt": "abort me", "max_tokens": 400, "ignore_eos": true,'
            ' "stream": true}').encode()
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        data = b""
        while b"data:" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            data += chunk
        return True
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        sock.close()


def normal_request(base_url: str, api_key: str, model: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {api_key}"}
    return httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60).status_code


def stalled_bodies(
    base_url: str, api_key: str, forwarded_for: list[str], attempts: int = 10
) -> list[socket.socket]:
    """One request per address in `forwarded_for` (sent as a forged X-Forwarded-For), each with its
    headers and 10 of its 1000 body bytes, held open: all in flight at the server at once. A request
    of an earlier test that the server still counts from this client can get one of them a 429 at
    once (seen: a /ready probe still in flight); then all are closed and sent again, so the caller
    holds exactly len(forwarded_for) requests in flight."""
    for _ in range(attempts):
        socks = []
        for forged in forwarded_for:
            sock = connect(base_url)
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {api_key}\r\nX-Forwarded-For: {forged}\r\n".encode()
                + b"Content-Length: 1000\r\n\r\n"
                + b'{"model": '
            )
            socks.append(sock)
        answered, _, _ = select.select(socks, [], [], 0.3)  # a refusal comes in milliseconds
        if not answered:
            return socks
        for sock in socks:
            sock.close()
        time.sleep(0.5)  # the earlier request leaves the count
    raise AssertionError(f"one of {len(forwarded_for)} stalled requests was answered, {attempts} tries")
