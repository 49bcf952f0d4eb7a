"""`loopwarden serve` under connection exhaustion: a process with few descriptors, clients that
send half a request and stop. The proxy keeps answering `/healthz`, and slow clients are cut off
by the header and body deadlines."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from proxy.demo.runner import free_port
from tests.e2e.conftest import ROOT, wait_healthy

pytestmark = pytest.mark.e2e

DESCRIPTORS = 256  # the proxy's RLIMIT_NOFILE: its default connection limit is 96
HALF_BODY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
    b"content-length: 1000\r\n\r\n" + b'{"model": "m", "messages": ['
)


def _few_descriptors() -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))

    return limit


@contextlib.contextmanager
def proxy(tmp_path: Path, server: dict[str, Any] | None = None) -> Iterator[tuple[str, int]]:
    """`loopwarden serve` with RLIMIT_NOFILE at DESCRIPTORS; yields its host and port."""
    config: dict[str, Any] = {
        "upstreams": {"main": {"base_url": "http://127.0.0.1:9/v1", "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "memory"},
    }
    if server:
        config["server"] = server
    path = tmp_path / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
    proc = subprocess.Popen(args, env=env, preexec_fn=_few_descriptors())
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        yield "127.0.0.1", port
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def half_sent(host: str, port: int, data: bytes) -> socket.socket | None:
    """A connection that sent `data` and nothing more; None when it could not connect."""
    sock = socket.socket()
    sock.settimeout(2)
    try:
        sock.connect((host, port))
        sock.sendall(data)
    except OSError:
        sock.close()
        return None
    return sock


def answer_of(sock: socket.socket, within_s: float) -> bytes:
    """What the server sent until it closed the connection (b"" if it closed without a word)."""
    sock.settimeout(within_s)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_healthz_answers_while_more_clients_than_descriptors_hold_half_sent_bodies(
    tmp_path: Path,
) -> None:
    with proxy(tmp_path) as (host, port), contextlib.ExitStack() as held:
        for _ in range(DESCRIPTORS + 100):
            sock = half_sent(host, port, HALF_BODY)
            if sock is not None:
                held.callback(sock.close)
        started = time.monotonic()
        r = httpx.get(f"http://{host}:{port}/healthz", timeout=10)
        assert r.status_code == 200
        assert time.monotonic() - started < 5  # the body deadline (30 s) did not free room
        assert httpx.get(f"http://{host}:{port}/readyz", timeout=10).status_code == 200


def test_connections_past_the_limit_are_refused_with_a_503(tmp_path: Path) -> None:
    server = {"max_connections": 4, "header_timeout_s": 30}
    with proxy(tmp_path, server) as (host, port), contextlib.ExitStack() as held:
        idle = [half_sent(host, port, b"") for _ in range(4)]
        for sock in idle:
            assert sock is not None
            held.callback(sock.close)
        time.sleep(0.2)  # the server has accepted them
        refused = half_sent(host, port, b"")
        assert refused is not None
        held.callback(refused.close)
        answer = answer_of(refused, 5)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert orjson.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "server_busy"


def test_probes_and_scrapes_have_a_port_of_their_own_that_clients_cannot_fill(
    tmp_path: Path,
) -> None:
    probe_port = free_port()
    server = {"max_connections": 4, "header_timeout_s": 30, "probe_port": probe_port}
    with proxy(tmp_path, server) as (host, port), contextlib.ExitStack() as held:
        for _ in range(6):
            sock = half_sent(host, port, b"")
            assert sock is not None
            held.callback(sock.close)
        time.sleep(0.2)  # the server has accepted them
        assert httpx.get(f"http://{host}:{port}/healthz", timeout=5).status_code == 503
        probes = httpx.Client(base_url=f"http://{host}:{probe_port}", timeout=5)
        held.callback(probes.close)
        assert probes.get("/healthz").json() == {"status": "ok"}
        assert probes.get("/readyz").json() == {"status": "ready"}
        assert "loopwarden_runs_total" in probes.get("/metrics").text
        refused = probes.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "not_found"
        assert "/healthz, /metrics, /readyz only" in refused.json()["error"]["message"]
        # Past its 32: connections answered and kept alive, that sent a head and hold back its
        # body, that say nothing.
        answered = b"GET /healthz HTTP/1.1\r\nhost: p\r\n\r\n"
        no_body = b"POST /healthz HTTP/1.1\r\nhost: p\r\ncontent-length: 1000\r\n\r\n"
        idle = [half_sent(host, probe_port, sent) for sent in [answered, no_body] * 18]
        idle += [half_sent(host, probe_port, b"") for _ in range(4)]
        for sock in idle:
            assert sock is not None
            held.callback(sock.close)
        time.sleep(0.5)
        with httpx.Client(base_url=f"http://{host}:{probe_port}", timeout=5) as fresh:
            assert fresh.get("/healthz").status_code == 200  # the longest idle made room
        assert sum(closed(sock) for sock in idle if sock is not None) == 40 + 1 - 32


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (after what it sent on it, if anything)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_client_that_stops_mid_body_gets_a_408_and_its_connection_closed(
    tmp_path: Path,
) -> None:
    with proxy(tmp_path, {"body_timeout_s": 0.5}) as (host, port):
        sock = half_sent(host, port, HALF_BODY)
        assert sock is not None
        with sock:
            answer = answer_of(sock, 10)  # returns once the proxy closed the connection
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in head.lower()
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_timeout"
    assert "body_timeout_s" in error["message"]


def test_a_client_that_stops_mid_headers_is_disconnected(tmp_path: Path) -> None:
    with proxy(tmp_path, {"header_timeout_s": 0.5}) as (host, port):
        silent = half_sent(host, port, b"")
        halfway = half_sent(host, port, b"GET /healthz HTTP/1.1\r\nhost: pro")
        assert silent is not None
        assert halfway is not None
        with silent, halfway:
            assert answer_of(silent, 10) == b""
            assert answer_of(halfway, 10) == b""


def test_an_idle_kept_alive_connection_is_closed(tmp_path: Path) -> None:
    with proxy(tmp_path, {"keep_alive_timeout_s": 1}) as (host, port):
        sock = half_sent(host, port, b"GET /healthz HTTP/1.1\r\nhost: proxy\r\n\r\n")
        assert sock is not None
        with sock:
            answer = answer_of(sock, 10)
    assert answer.startswith(b"HTTP/1.1 200 ")  # answered, then closed when idle


def sent_in_pieces(host: str, port: int, data: bytes, piece: int = 16 * 1024) -> bytes:
    """What the server answers to `data` sent a piece at a time, until it closes."""
    with socket.create_connection((host, port), timeout=10) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for start in range(0, len(data), piece):
                sock.sendall(data[start : start + piece])
                time.sleep(0.001)
        return answer_of(sock, 10)


def test_a_request_head_over_64_kib_is_answered_431_and_its_connection_closed(
    tmp_path: Path,
) -> None:
    def healthz(header_bytes: int) -> bytes:
        return b"GET /healthz HTTP/1.1\r\nhost: proxy\r\nconnection: close\r\nx-pad: %s\r\n\r\n" % (
            b"a" * header_bytes
        )

    long_body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]}
    )
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\nconnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(long_body)
    ) + long_body
    with proxy(tmp_path) as (host, port):
        over = sent_in_pieces(host, port, healthz(1024 * 1024))
        whole = healthz(200 * 1024)  # a head that may come in one read
        over_at_once = sent_in_pieces(host, port, whole, piece=len(whole))
        under = sent_in_pieces(host, port, healthz(60 * 1024))
        under_at_once = sent_in_pieces(host, port, healthz(64 * 1024 - 200), piece=1 << 20)
        posted = sent_in_pieces(host, port, post, piece=len(post))  # a head, then a long body
    head, body = over.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 431 ")
    assert b"connection: close" in head
    error = orjson.loads(body)["error"]
    assert (error["code"], error["type"]) == ("request_too_large", "invalid_request_error")
    assert "longer than 65536 bytes" in error["message"]
    head, body = over_at_once.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 431 ")
    assert b"connection: close" in head
    assert orjson.loads(body)["error"] == error
    assert under.startswith(b"HTTP/1.1 200 ")
    assert under_at_once.startswith(b"HTTP/1.1 200 ")
    assert posted.startswith(b"HTTP/1.1 502 ")  # served: the upstream is unreachable


def test_a_request_pipelined_behind_a_long_body_is_served(tmp_path: Path) -> None:
    """A read holding the end of one request's long body and the start of the next request's
    head is no long head: both are answered."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]})
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    ) + body
    get = b"GET /healthz HTTP/1.1\r\nhost: proxy\r\nconnection: close\r\n\r\n"
    cut = len(post) - len(body) + 1000
    with proxy(tmp_path) as (host, port), socket.create_connection((host, port)) as sock:
        sock.sendall(post[:cut])
        time.sleep(0.2)
        sock.sendall(post[cut:] + get[:10])  # 199 KB of body and a head begun, in one read
        time.sleep(0.2)
        sock.sendall(get[10:])
        answers = answer_of(sock, 10)
    assert answers.startswith(b"HTTP/1.1 502 ")  # served: the upstream is unreachable
    assert answers.count(b"HTTP/1.1 ") == 2
    assert b"HTTP/1.1 200 OK" in answers


def test_a_request_asking_to_upgrade_is_answered_and_its_connection_closed(
    tmp_path: Path,
) -> None:
    """No connection outlives its answer by asking for another protocol (a WebSocket POST was
    never answered nor closed)."""
    body = b'{"model":"m","messages":[]}'
    upgrades = [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\nconnection: Upgrade\r\n"
        b"upgrade: websocket\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
        b"GET /healthz HTTP/1.1\r\nhost: proxy\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
    ]
    with proxy(tmp_path) as (host, port):
        for request in upgrades:
            sock = half_sent(host, port, request)
            assert sock is not None
            with sock:
                answer = answer_of(sock, 5)
            head, error = answer.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 400 ")
            assert orjson.loads(error)["error"]["type"] == "invalid_request_error"


def test_a_probe_in_flight_when_the_server_stops_is_answered_whole(tmp_path: Path) -> None:
    """A readiness check that waits on the state backend (another process holds the sqlite
    file's write lock) as SIGTERM comes: the server answers it before it stops."""
    probe_port = free_port()
    database = tmp_path / "state.db"
    config: dict[str, Any] = {
        "upstreams": {"main": {"base_url": "http://127.0.0.1:9/v1", "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "sqlite", "path": str(database), "timeout_s": 10},
        "server": {"probe_port": probe_port},
    }
    path = tmp_path / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
    proc = subprocess.Popen(args, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{probe_port}/readyz", proc)
        with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as holder:
            holder.execute("BEGIN IMMEDIATE")  # writers wait, as the readiness check does
            with ThreadPoolExecutor(1) as pool:
                probe = pool.submit(httpx.get, f"http://127.0.0.1:{probe_port}/readyz", timeout=20)
                time.sleep(0.5)  # the check is waiting for the lock
                proc.send_signal(signal.SIGTERM)
                time.sleep(1.0)
                holder.execute("ROLLBACK")
                answer = probe.result(timeout=20)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"status": "ready"}
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)  # uvicorn ends as the signal did
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
