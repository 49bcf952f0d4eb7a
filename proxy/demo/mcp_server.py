"""The demo's MCP server: one tool over stdio, written with the `mcp` package's server API.

Run by the proxy as a child (`kind: mcp`, `command: [python, this file]`); it imports nothing of
the proxy, so it runs with the child's own small environment.
"""

from __future__ import annotations

from typing import TypedDict

from mcp.server import MCPServer

SUNRISE = {"Paris": "08:21", "Oslo": "08:57", "Lima": "05:47"}


class Sunrise(TypedDict):
    city: str
    sunrise: str


def build() -> MCPServer:
    server = MCPServer("loopwarden-almanac", log_level="WARNING")

    @server.tool()
    def sunrise(city: str) -> Sunrise:
        """Today's sunrise in a city, local time."""
        return {"city": city, "sunrise": SUNRISE.get(city, "07:00")}

    return server


if __name__ == "__main__":
    build().run("stdio")
