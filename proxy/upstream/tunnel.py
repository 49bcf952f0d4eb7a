"""A `CONNECT` tunnel through a web proxy (`proxy.egress`): how an https upstream is reached
behind a company's egress proxy; TLS to the upstream then runs through it."""

from __future__ import annotations

import asyncio
import socket

from proxy.deadline import within
from proxy.egress import WebProxy
from proxy.upstream.http1_connection import ConnectTimeout, Unreachable

MAX_TUNNEL_HEAD = 16 * 1024  # the most of a proxy's answer to CONNECT read before its end


async def tunnel(proxy: WebProxy, host: str, port: int, connect_s: float) -> socket.socket:
    """A socket to `host:port` through `proxy`, its `CONNECT` answered 200, within
    `connect_s`."""
    try:
        return await within(_tunnel(proxy, host, port), connect_s)
    except TimeoutError:
        raise ConnectTimeout(
            f"no tunnel to {host}:{port} through the proxy {proxy.name} in time"
        ) from None


async def _tunnel(proxy: WebProxy, host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = await _connected(proxy)
    try:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"host: {authority}"]
        if proxy.authorization is not None:
            lines.append(f"proxy-authorization: {proxy.authorization}")
        await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            read = await loop.sock_recv(sock, MAX_TUNNEL_HEAD)
            if not read:
                raise Unreachable(f"the proxy {proxy.name} closed the tunnel to {authority}")
            head += read
            if len(head) > MAX_TUNNEL_HEAD:
                raise Unreachable(f"the proxy {proxy.name} sent a head past {MAX_TUNNEL_HEAD} B")
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = status.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or parts[1] != "200":
            raise Unreachable(
                f"the proxy {proxy.name} refused the tunnel to {authority}: {status[:200]!r}"
            )
        if not head.endswith(b"\r\n\r\n"):
            raise Unreachable(f"the proxy {proxy.name} spoke for {authority} before the client")
    except BaseException:
        sock.close()
        raise
    return sock


async def _connected(proxy: WebProxy) -> socket.socket:
    loop = asyncio.get_running_loop()
    try:
        found = await loop.getaddrinfo(proxy.host, proxy.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Unreachable(f"cannot find the proxy {proxy.name} ({exc})") from None
    failure: OSError | None = None
    for family, kind, protocol, _, address in found:
        sock = socket.socket(family, kind, protocol)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            failure = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise Unreachable(f"cannot connect to the proxy {proxy.name} ({failure})")
