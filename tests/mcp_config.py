"""`kind: mcp` entries for the tests' MCP server (`tests/mcp_server.py`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SERVER = Path(__file__).with_name("mcp_server.py")
NOISY = Path(__file__).with_name("mcp_noisy_stdio.py")  # a stdio server hostile by hand


def stdio_entry(**extra: Any) -> dict[str, Any]:
    """The server as a stdio child, its tools exposed as `t_<tool>`."""
    return {
        "kind": "mcp",
        "command": [sys.executable, str(SERVER), "stdio"],
        "prefix": "t_",
        "timeout_s": 5,
        "connect_timeout_s": 30,
        **extra,
    }


def http_entry(url: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "mcp", "url": url, "timeout_s": 5, "connect_timeout_s": 10, **extra}


def http_server_args(port: int, legacy: bool = True, *options: str) -> list[str]:
    """The arguments of `python` that serve the tests' MCP server on 127.0.0.1:port/mcp, with
    more `options` of tests/mcp_server.py."""
    return [str(SERVER), "http", str(port), *(["legacy"] if legacy else []), *options]
