"""What a second worker buys on this machine, and what this machine allows at most.

    python -m tests.bench.scaling [--seconds 8] [--reps 3] [--conc 64] [--modes json,stream]

Three targets, each on sqlite state, the mock upstream and wrk on CPU 0, the same closed-loop
load, interleaved: **one worker** (on CPU 1), **`serve --workers 2`** (both cores), and **two
processes**: two independent one-worker servers, one pinned to each core with state of its
own, each taking half the connections. Two processes share nothing, so their throughput is the
most that two of anything could carry beside wrk and the mock here: the bound to compare the
second worker with, on a machine whose load generator shares its cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.bench.load import wrk
from tests.bench.processes import cpu_seconds, running

ONE, WORKERS, PROCESSES = "one worker", "serve --workers 2", "two processes"


@dataclass
class Target:
    name: str
    urls: list[str]  # one server, or one per process (the connections split among them)
    pids: list[int]


def load(target: Target, mode: str, conc: int, seconds: float) -> dict[str, float]:
    """RPS and CPU per request (ms) of the target's processes under `conc` connections."""
    share = max(1, conc // len(target.urls))
    results: list[dict[str, Any]] = []
    before = sum(cpu_seconds(pid) for pid in target.pids)

    def one(url: str) -> None:
        results.append(wrk(url, "mock", conc=share, seconds=seconds, stream=mode == "stream",
                           cpus="0"))  # fmt: skip

    threads = [threading.Thread(target=one, args=(url,)) for url in target.urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spent = sum(cpu_seconds(pid) for pid in target.pids) - before
    if len(results) != len(target.urls):
        raise RuntimeError(f"wrk failed against {target.name}")
    requests = sum(r["requests"] for r in results)
    errors = sum(r["error_count"] for r in results)
    if errors or not requests:
        raise RuntimeError(f"{target.name}: {errors} errors in {requests} requests")
    return {"rps": sum(r["rps"] for r in results), "cpu": 1000 * spent / requests}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per row and rep")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--conc", type=int, default=64)
    parser.add_argument("--modes", default="json,stream")
    args = parser.parse_args(argv)
    untraced = {"OTEL_TRACES_EXPORTER": "none"}
    with tempfile.TemporaryDirectory() as folder, running(Path(folder)) as servers:
        mock, _ = servers.mock("0")
        single, single_pid = servers.loopwarden(mock, 1, "1", sqlite=True, **untraced)
        pair, pair_pid = servers.loopwarden(mock, 2, "", sqlite=True, **untraced)
        first, first_pid = servers.loopwarden(mock, 1, "0", sqlite=True, **untraced)
        second, second_pid = servers.loopwarden(mock, 1, "1", sqlite=True, **untraced)
        targets = [
            Target(ONE, [single], [single_pid]),
            Target(WORKERS, [pair], [pair_pid]),
            Target(PROCESSES, [first, second], [first_pid, second_pid]),
        ]
        modes = args.modes.split(",")
        for target in targets:  # warm-up
            load(target, modes[0], args.conc, 1)
        rows: dict[tuple[str, str], list[dict[str, float]]] = {}
        for rep in range(args.reps):
            order = targets[rep % 3 :] + targets[: rep % 3]
            for mode in modes:
                for target in order:
                    rows.setdefault((mode, target.name), []).append(
                        load(target, mode, args.conc, args.seconds)
                    )
    print(f"c={args.conc}, medians of {args.reps} interleaved reps of {args.seconds:g} s, "
          "sqlite state, mock and wrk on CPU 0\n")  # fmt: skip
    print("| mode | target | RPS | x one worker | CPU ms/req |")
    print("|---|---|---|---|---|")
    for mode in modes:
        base = statistics.median(r["rps"] for r in rows[(mode, ONE)])
        for name in (ONE, WORKERS, PROCESSES):
            rps = statistics.median(r["rps"] for r in rows[(mode, name)])
            cpu = statistics.median(r["cpu"] for r in rows[(mode, name)])
            print(f"| {mode} | {name} | {rps:,.0f} | {rps / base:.2f}x | {cpu:.3f} |")
    print()
    for mode in modes:
        workers = statistics.median(r["rps"] for r in rows[(mode, WORKERS)])
        bound = statistics.median(r["rps"] for r in rows[(mode, PROCESSES)])
        print(
            f"- {mode}: serve --workers 2 carries {workers / bound:.0%} of what two "
            "independent processes carry here"
        )


if __name__ == "__main__":
    main()
