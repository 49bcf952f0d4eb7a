"""The web proxy an upstream is reached through, as the environment names it (`HTTPS_PROXY`,
`HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`, any case): https upstreams through a `CONNECT` tunnel,
http ones with their absolute URL in the request line. Only `http://` proxies are spoken to; a
proxy named otherwise is logged once and its upstreams reached directly."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import socket
import urllib.request
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from proxy.upstream.http1_connection import ConnectTimeout, Unreachable

log = logging.getLogger(__name__)

MAX_TUNNEL_HEAD = 16 * 1024  # the most of a proxy's answer to CONNECT read before its end


@dataclass(frozen=True, slots=True)
class WebProxy:
    host: str
    port: int
    authorization: str | None  # the `proxy-authorization` value, from the URL's user and password

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


class Egress:
    """The proxies the environment names, read once (as urllib reads them). A loopback host
    (`localhost`, 127.0.0.0/8, ::1) is always reached directly, as Go's and curl's clients do."""

    def __init__(self) -> None:
        found = urllib.request.getproxies_environment()
        self._proxies = {
            scheme: _web_proxy(scheme, found.get(scheme) or found.get("all"))
            for scheme in ("http", "https")
        }
        self._direct = DirectHosts(found.get("no", ""))

    def proxy_for(self, scheme: str, host: str) -> WebProxy | None:
        """The proxy that `scheme` URLs of `host` go through, or None: direct. (Asked once a
        URL and once a connection: the transport keeps what it parsed.)"""
        proxy = self._proxies.get(scheme)
        if proxy is None or self._direct.holds(host):
            return None
        return proxy


def _web_proxy(scheme: str, url: str | None) -> WebProxy | None:
    if not url:
        return None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        log.warning(
            "the %s proxy %r is not an http:// proxy URL: %s upstreams are reached directly",
            scheme,
            f"{parts.scheme}://{parts.hostname}",
            scheme,
        )
        return None
    authorization = None
    if parts.username is not None:
        secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(secret.encode()).decode()
    return WebProxy(parts.hostname, port, authorization)


class DirectHosts:
    """The hosts `NO_PROXY` names, in the forms clusters write it: `*`, a domain and its
    subdomains (`example.com`, `.example.com`, `*.example.com`), an address or a network in CIDR
    (`10.0.0.0/8`, `[::1]`), each with or without a port; and every loopback host."""

    def __init__(self, no_proxy: str) -> None:
        self.everything = False
        self.domains: list[str] = []
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for raw in no_proxy.split(","):
            entry = raw.strip().lower()
            if entry == "*":
                self.everything = True
            elif entry:
                self._add(entry)

    def _add(self, entry: str) -> None:
        if entry.startswith("["):  # [v6] or [v6]:port
            entry = entry[1 : entry.find("]")] if "]" in entry else entry[1:]
        elif entry.count(":") == 1:  # host:port
            entry = entry.split(":", 1)[0]
        try:
            self.networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            domain = entry.removeprefix("*").strip(".")
            if domain:
                self.domains.append(domain)

    def holds(self, host: str) -> bool:
        host = host.lower().strip("[]").rstrip(".")
        if self.everything or host == "localhost" or host.endswith(".localhost"):
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return any(host == d or host.endswith("." + d) for d in self.domains)
        return address.is_loopback or any(address in network for network in self.networks)


async def tunnel(proxy: WebProxy, host: str, port: int, connect_s: float) -> socket.socket:
    """A socket to `host:port` through `proxy`, its `CONNECT` answered 200, within
    `connect_s`."""
    try:
        return await asyncio.wait_for(_tunnel(proxy, host, port), connect_s)
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
