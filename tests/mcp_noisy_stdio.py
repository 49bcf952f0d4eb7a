"""A stdio MCP server that speaks the protocol by hand, to be hostile where the SDK would not
let it: its one tool, `noise`, writes `lines` lines before its answer (notifications, or no
message at all with `junk`), or its answer `lines` times (`answers`). `hang PATH`: it writes
its pid to PATH and never answers `initialize`, whatever it is sent (its stdin closed,
SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def send(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    if sys.argv[1:2] == ["hang"]:
        Path(sys.argv[2]).write_text(str(os.getpid()))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    tool = {"name": "noise", "inputSchema": {"type": "object"}}
    for line in sys.stdin:
        request = json.loads(line)
        method, request_id = request.get("method"), request.get("id")
        if method == "initialize":
            version = request["params"]["protocolVersion"]
            info = {"name": "noisy", "version": "1"}
            result = {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info}
            send({"jsonrpc": "2.0", "id": request_id, "result": result})
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": request_id, "result": {"tools": [tool]}})
        elif method == "tools/call":
            arguments = request["params"].get("arguments") or {}
            content = [{"type": "text", "text": "done"}]
            if arguments.get("answers"):  # its answer, again and again
                answer = json.dumps(
                    {"jsonrpc": "2.0", "id": request_id, "result": {"content": content}}
                )
                sys.stdout.write((answer + "\n") * int(arguments.get("lines", 5000)))
                sys.stdout.flush()
                continue
            for i in range(int(arguments.get("lines", 5000))):
                if arguments.get("junk"):
                    sys.stdout.write(f"noise {i}\n")
                else:
                    params = {"level": "info", "data": f"noise {i}"}
                    send({"jsonrpc": "2.0", "method": "notifications/message", "params": params})
            send({"jsonrpc": "2.0", "id": request_id, "result": {"content": content}})
        elif request_id is not None:
            send({"jsonrpc": "2.0", "id": request_id, "result": {}})


if __name__ == "__main__":
    main()
