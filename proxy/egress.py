"""The web proxy a host is reached through, as the environment names it (`HTTPS_PROXY`,
`HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`, any case), for the upstreams and the tool servers alike.
Only `http://` proxies are spoken to; a proxy named otherwise is logged once and its hosts
reached directly."""

from __future__ import annotations

import base64
import ipaddress
import logging
import urllib.request
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WebProxy:
    host: str
    port: int
    auth: tuple[str, str] | None  # the URL's user and password

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The proxy's URL, without its user and password (`auth`)."""
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.name}"

    @property
    def authorization(self) -> str | None:
        """The `proxy-authorization` value each request to the proxy carries, if any."""
        if self.auth is None:
            return None
        return "Basic " + base64.b64encode(":".join(self.auth).encode()).decode()


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
        """The proxy that `scheme` URLs of `host` go through, or None: direct. (The upstreams'
        transport asks once a URL and once a connection; the tools' once a request.)"""
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
            "the %s proxy %r is not an http:// proxy URL: %s hosts are reached directly",
            scheme,
            f"{parts.scheme}://{parts.hostname}",
            scheme,
        )
        return None
    auth = None
    if parts.username is not None:
        auth = (unquote(parts.username), unquote(parts.password or ""))
    return WebProxy(parts.hostname, port, auth)


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
