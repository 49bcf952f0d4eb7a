"""Real servers for the tests, started on 127.0.0.1 and stopped after."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from proxy.demo.runner import free_port


@contextlib.contextmanager
def redis_server(workdir: Path, port: int | None = None) -> Iterator[str]:
    """A throwaway redis-server (Debian's `redis-server`), on `port` or a free one; yields its
    URL. Started again on the same port, a client of the first finds the second."""
    with redis_process(workdir, port) as (url, _):
        yield url


@contextlib.contextmanager
def redis_process(
    workdir: Path, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`redis_server`, with its process (to pause it, say)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    port = port or free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*args, "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
