"""`server`: the listener, its bounds, and the pools and threads it shares among requests."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from proxy.config.model import ConfigModel

# Descriptors the process keeps for itself (state files, logs, listeners) before client
# connections, upstream connections and tool connections share the rest.
FD_HEADROOM = 64


# The soft RLIMIT_NOFILE a serving process raises itself to, at most (its hard limit bounds it).
WANTED_DESCRIPTORS = 65536


def raise_descriptor_limit(wanted: int = WANTED_DESCRIPTORS) -> int:
    """Raises the process's soft RLIMIT_NOFILE toward its hard one, at most to `wanted`, as
    servers do (under a soft limit of 1,024, systemd's default, a process held 480 client
    connections: 1,000 held streams were half refused); the soft limit after."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError):
        pass
    return _descriptor_limit()


def _descriptor_limit() -> int:
    """The process's soft RLIMIT_NOFILE; 1,024 where it cannot be read or is unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    return soft if 0 < soft < 2**31 else 1024


class ServerConfig(ConfigModel):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # A second listener, on the same host, that serves only /healthz, /readyz and /metrics with
    # connections of its own: probes and scrapes are answered while clients hold every
    # connection of `port`.
    probe_port: int | None = Field(None, ge=1, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # JSON values a request body (or an MCP server's message) may hold, keys counted: parsing
    # is bounded before it starts.
    max_body_values: int = Field(100_000, ge=1000)
    keepalive_interval_s: float = Field(15.0, gt=0, allow_inf_nan=False)
    # Client connections held at once; more are closed as they arrive. Unset: half of the
    # descriptors left after FD_HEADROOM, since a client connection may hold an upstream one.
    max_connections: int | None = Field(None, ge=1)
    header_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)  # request line + headers
    body_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)  # the whole request body
    keep_alive_timeout_s: int = Field(5, ge=1)  # an idle connection between requests
    # After SIGTERM: how long the runs in flight get to end; one still going then is stopped
    # (503 `shutting_down`, or its stream cut short).
    shutdown_timeout_s: float = Field(30.0, ge=0, le=86400, allow_inf_nan=False)
    max_concurrent_runs: int = Field(1000, ge=1)  # runs in flight; more answer 503
    tool_threads: int = Field(16, ge=1)  # threads for sync python tools and conditions
    tool_connections: int = Field(100, ge=1)  # http tools' and webhooks' connection pool
    upstream_connections: int = Field(1000, ge=1)  # the upstreams' connection pool
    upstream_pool_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    max_tool_output_bytes: int = Field(1024 * 1024, ge=1)  # each tool's own cap overrides
    # What the tool calls of one run may give the model together; past it a call's output is a
    # tool error (128 parallel calls of 1 MiB each sent the upstream a body of 131 MB).
    max_run_tool_output_bytes: int = Field(16 * 1024 * 1024, ge=1)
    workers: int = Field(1, ge=1, le=256)  # processes behind one port (`serve --workers`)
    # How `/v1/responses` shows the server tool calls that ran: as `mcp_call` output items, or
    # not at all (for a client that cannot read them).
    responses_server_calls: Literal["mcp_call", "omit"] = "mcp_call"

    @model_validator(mode="after")
    def _two_ports(self) -> ServerConfig:
        if self.probe_port is not None and self.probe_port == self.port:
            raise ValueError("probe_port must differ from port: probes get a listener of their own")
        return self

    def connection_limit(self) -> int:
        """Client connections held at once: `max_connections`, else derived from the
        process's descriptor limit."""
        if self.max_connections is not None:
            return self.max_connections
        return max(16, (_descriptor_limit() - FD_HEADROOM) // 2)

    def request_limit(self) -> int:
        """Requests in flight at once, health probes aside: a little below the connection
        limit, so that a probe still finds a connection and an answer when every other
        request is slow."""
        limit = self.connection_limit()
        return max(1, limit - max(8, limit // 16))
