"""What a sync tool that computes does to everyone else's requests: pass-through latency at c=1
alone, then while runs keep a `python` tool busy computing in its thread.

    python -m tests.bench.busy_tool [--seconds 5]

The tool's thread and the event loop share the GIL; how long the loop waits for it at each
wake-up is the interpreter's switch interval, which a serving process shortens
(`proxy.api.runtime.SWITCH_INTERVAL_S`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import orjson
import yaml

from proxy.demo.runner import free_port
from tests.bench.load import wrk
from tests.bench.processes import loopwarden_config, running


def crunch(seconds: float) -> str:
    """Computes in Python for `seconds` (the bench mock asks for 1)."""
    end = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < end:
        rounds += sum(i * i for i in range(200)) & 1
    return f"{rounds} rounds"


def keep_busy(url: str, stop: threading.Event, done: list[str]) -> None:
    """Runs of an agent whose model calls `crunch`, one after the other, until `stop`; the stop
    reason of each goes to `done`."""
    body = orjson.dumps({"model": "busy-agent", "messages": [{"role": "user", "content": "go"}]})
    while not stop.is_set():
        request = urllib.request.Request(
            url + "/chat/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            done.append(orjson.loads(response.read())["loop"]["stop_reason"])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per row")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder, running(Path(folder)) as servers:
        mock, _ = servers.mock("0")
        config = loopwarden_config(mock, Path(folder), False, {})
        config["tools"]["crunch"] = {"kind": "python", "callable": "tests.bench.busy_tool:crunch"}
        config["agents"]["busy-agent"] = {"model": "mock", "tools": ["crunch"]}
        port = free_port()
        path = Path(folder) / "loopwarden.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
        servers.start(argv, f"http://127.0.0.1:{port}/healthz", OTEL_TRACES_EXPORTER="none")
        url = f"http://127.0.0.1:{port}/v1"
        wrk(url, "mock", conc=1, seconds=2, stream=False)  # warm-up
        print("| pass-through JSON, c=1 | RPS | p50 ms | p99 ms |\n|---|---|---|---|")
        for busy in (False, True):
            stop, done = threading.Event(), []
            runner = threading.Thread(target=keep_busy, args=(url, stop, done), daemon=True)
            if busy:
                runner.start()
                time.sleep(0.5)  # the first tool call is computing
            result = wrk(url, "mock", conc=1, seconds=args.seconds, stream=False)
            stop.set()
            if busy:
                runner.join()
            label = "while a tool computes" if busy else "alone"
            rps, p50, p99 = result["rps"], result["p50_ms"], result["p99_ms"]
            print(f"| {label} | {rps:,.0f} | {p50:.2f} | {p99:.2f} |")
        reasons = sorted(set(done))
        print(f"\nruns of the computing tool meanwhile: {len(done)}, stopped by {reasons}")


if __name__ == "__main__":
    main()
