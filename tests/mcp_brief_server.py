"""A stdio MCP server whose sessions end as soon as they begin: it notes each start in a file,
answers the handshake and its tool list, and exits.

    python tests/mcp_brief_server.py STARTS_FILE
"""

from __future__ import annotations

import json
import sys

TOOL = {"name": "brief", "description": "Never called.", "inputSchema": {"type": "object"}}


def send(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
    sys.stdout.flush()


def main() -> None:
    with open(sys.argv[1], "a") as starts:
        starts.write("started\n")
    for line in sys.stdin:
        request = json.loads(line)
        if "id" not in request or "method" not in request:
            continue
        if request["method"] == "initialize":
            version = request["params"]["protocolVersion"]
            info = {"name": "brief", "version": "1"}
            result = {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info}
            send({"id": request["id"], "result": result})
        elif request["method"] == "tools/list":
            send({"id": request["id"], "result": {"tools": [TOOL]}})
            return  # the session ends
        else:
            send({"id": request["id"], "error": {"code": -32601, "message": "Method not found"}})


if __name__ == "__main__":
    main()
