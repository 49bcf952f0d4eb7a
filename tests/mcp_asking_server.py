"""A stdio MCP server that asks its client more than it reads: its one tool, `ask`, sends
`count` requests of `method` to the client, answers the call, then reads no more of its stdin.
Written by hand, since the `mcp` package's servers read every answer they ask for. `cancelling`:
every 16 requests are followed by a `notifications/cancelled` of each; `one-id`: the same, all
with one id.

    python tests/mcp_asking_server.py [method] [cancelling | one-id]
"""

from __future__ import annotations

import json
import sys
import time

TOOL = {
    "name": "ask",
    "description": "Asks the client `count` times, then stops reading.",
    "inputSchema": {
        "type": "object",
        "properties": {"count": {"type": "integer"}},
        "required": ["count"],
    },
}


def send(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
    sys.stdout.flush()


def asks(count: int, method: str, mode: str) -> str:
    """The lines of `count` requests (and cancellations, by `mode`)."""
    lines = []
    for n in range(count):
        ask_id = "ask" if mode == "one-id" else f"ask-{n}"
        lines.append({"jsonrpc": "2.0", "id": ask_id, "method": method})
        if mode and n % 16 == 15:
            ids = ["ask"] * 16 if mode == "one-id" else [f"ask-{k}" for k in range(n - 15, n + 1)]
            lines += [
                {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": i}}
                for i in ids
            ]
    return "".join(json.dumps(line) + "\n" for line in lines)


def answer(request: dict[str, object], method: str, mode: str) -> bool:
    """Answers `request`; False once the server has stopped reading."""
    name, params = request["method"], request.get("params") or {}
    assert isinstance(params, dict)
    if name == "initialize":
        version = params.get("protocolVersion")
        info = {"name": "asking", "version": "1"}
        result = {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info}
        send({"id": request["id"], "result": result})
    elif name == "tools/list":
        send({"id": request["id"], "result": {"tools": [TOOL]}})
    elif name == "tools/call":
        count = int(params["arguments"]["count"])
        sys.stdout.write(asks(count, method, mode))
        text = {"type": "text", "text": f"asked {count}"}
        send({"id": request["id"], "result": {"content": [text]}})
        return False
    else:
        send({"id": request["id"], "error": {"code": -32601, "message": "Method not found"}})
    return True


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "roots/list"
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    for line in sys.stdin:
        request = json.loads(line)
        if "id" in request and "method" in request and not answer(request, method, mode):
            break
    time.sleep(3600)  # reads no more: the client's answers fill the pipe


if __name__ == "__main__":
    main()
