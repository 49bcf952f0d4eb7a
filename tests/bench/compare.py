"""The side-by-side: what Loopwarden adds over calling the upstream directly and over the floor
of a Python relay (and over LiteLLM, when it is installed), on this machine, in one run.

    python -m tests.bench.compare [--duration S] [--reps N] [--conc 1,64] [--modes json,stream]
        [--workers N] [--server uvicorn|granian] [--tool-step] [--tracing] [--scaling]
        [--wrk-cpus 0] [--warmup S] [--ttft N] [--litellm auto|off|PATH] [--out FILE]

Starts the mock upstream (and wrk) on CPU 0, the floor (`tests.bench.floor`: on aiohttp's
client, and on Loopwarden's own as `floor http1`) and Loopwarden each on CPU 1 (when there are
two cores), runs wrk against every target in turn, the order rotating each rep, charges each
target's process tree its CPU time per request, then probes the time to the first token with
sequential streams whose chunks come 2 ms apart. Prints markdown tables of the medians over the
reps.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from tests.bench.load import ttft, wrk
from tests.bench.processes import Servers, busy_seconds, cores, cpu_seconds, own_seconds, running

LITELLM_KEY = "sk-bench-1234"


@dataclass
class Target:
    name: str
    url: str
    pid: int
    model: str = "mock"
    ttft_model: str | None = "mock+cd2"  # None: not probed
    key: str = ""


def start(servers: Servers, args: argparse.Namespace) -> list[Target]:
    mock, mock_pid = servers.mock("0")
    floor, floor_pid = servers.floor(mock, args.server, "1")
    # The same floor on Loopwarden's own upstream client, lighter than aiohttp's.
    floor_http1, floor_http1_pid = servers.floor(mock, args.server, "1", client="http1")
    workers = args.workers
    cpus = "1" if workers == 1 else ""  # several workers get every core
    untraced = {"OTEL_TRACES_EXPORTER": "none"}  # whatever this shell's OTEL_* say
    ours, ours_pid = servers.loopwarden(mock, workers, cpus, **untraced)
    name = "loopwarden" if workers == 1 else f"loopwarden x{workers}"
    targets = [Target("direct", mock, mock_pid), Target("floor", floor, floor_pid)]
    targets.append(Target("floor http1", floor_http1, floor_http1_pid))
    targets.append(Target(name, ours, ours_pid))
    if args.tool_step:
        targets.append(Target(f"{name} tool step", ours, ours_pid, "bench-agent", None))
        async_step = Target(f"{name} async tool step", ours, ours_pid, "bench-agent-async", None)
        targets.append(async_step)
    if args.tracing:
        receiver, _ = servers.mock("0")
        otlp = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.removesuffix("/v1"),
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
        # Exporting, and sampling no request (a ratio of 0), then every request.
        for label, sampler, ratio in (
            ("unsampled", "traceidratio", "0"),
            ("traced", "always_on", "1"),
        ):
            sampling = {
                "OTEL_TRACES_SAMPLER": f"parentbased_{sampler}",
                "OTEL_TRACES_SAMPLER_ARG": ratio,
            }
            url, pid = servers.loopwarden(mock, workers, cpus, **otlp, **sampling)
            targets.append(Target(f"{name} {label}", url, pid))
    if args.scaling:  # 2 workers over 1, both on sqlite: several workers cannot share memory
        single, single_pid = servers.loopwarden(mock, 1, "1", sqlite=True, **untraced)
        targets.append(Target("loopwarden sqlite", single, single_pid))
        scaled, scaled_pid = servers.loopwarden(mock, 2, "", **untraced)
        targets.append(Target("loopwarden x2", scaled, scaled_pid))
    litellm = shutil.which("litellm") if args.litellm == "auto" else args.litellm
    if litellm and litellm != "off":
        url, pid = servers.litellm(litellm, mock, LITELLM_KEY, "1")
        targets.append(Target("litellm", url, pid, ttft_model="mock-ttft", key=LITELLM_KEY))
    return targets


def load(target: Target, mode: str, conc: int, seconds: float, args: Any) -> dict[str, Any]:
    """One wrk run, with the target's CPU per request and the cores that processes other than
    the benchmark's kept busy meanwhile (noise from other tenants)."""
    before, own, busy = cpu_seconds(target.pid), own_seconds(args.pids), busy_seconds()
    started = time.monotonic()
    result = wrk(
        target.url, target.model, conc=conc, seconds=seconds, stream=mode == "stream",
        key=target.key, cpus=args.wrk_cpus,
    )  # fmt: skip
    spent = cpu_seconds(target.pid) - before
    others = (busy_seconds() - busy) - (own_seconds(args.pids) - own)
    result["other_cores"] = max(0.0, others) / (time.monotonic() - started)
    result["cpu_ms_per_req"] = 1000 * spent / result["requests"] if result["requests"] else None
    return result


def measure(targets: list[Target], args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    runs: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    for mode in args.modes:
        for conc in args.conc:
            for target in targets if args.warmup else []:
                load(target, mode, conc, args.warmup, args)
    for rep in range(args.reps):
        order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
        for mode in args.modes:
            for conc in args.conc:
                for target in order:
                    run = load(target, mode, conc, args.duration, args)
                    runs.append(
                        {**run, "rep": rep, "mode": mode, "conc": conc, "target": target.name}
                    )
                    say(f"rep {rep} {mode} c={conc} {target.name}: {run['rps']:.0f} rps, "
                        f"p50 {run['p50_ms']:.2f} ms, {run['error_count']} errors, "
                        f"other load {run['other_cores']:.2f} cores")  # fmt: skip
                    time.sleep(args.pause)
        for target in order:
            if args.ttft and target.ttft_model:
                probe = ttft(target.url, target.ttft_model, args.ttft, target.key)
                probes.append({**probe, "rep": rep, "target": target.name})
    return runs, probes


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def median_of(
    rows: list[dict[str, Any]], name: str, value: Callable[[dict[str, Any]], Any]
) -> float | None:
    values = [v for r in rows if r["target"] == name and (v := value(r)) is not None]
    return statistics.median(values) if values else None


def relative(
    rows: list[dict[str, Any]], base: str, key: str, op: Callable[[float, float], float]
) -> Callable[[dict[str, Any]], float | None]:
    """A row's `key` against the same rep's row of target `base` (`op(row, base)`)."""
    by_rep = {r["rep"]: r for r in rows if r["target"] == base}

    def value(row: dict[str, Any]) -> float | None:
        other = by_rep.get(row["rep"])
        if other is None or row[key] is None or not other[key]:
            return None
        return op(row[key], other[key])

    return value


def ratio(a: float, b: float) -> float:
    return a / b


def minus(a: float, b: float) -> float:
    return a - b


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"


def report(targets: list[Target], runs: list[Any], probes: list[Any], args: Any) -> str:
    names = [t.name for t in targets]
    lines = [
        "| mode | conc | target | RPS | x floor | p50 ms | p99 ms | added p50 ms | CPU ms/req "
        "| errors | other load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    extra: list[str] = []
    ours, scaled = names[3], "loopwarden x2"
    steps = {f"{ours} tool step": "sync", f"{ours} async tool step": "async"}
    for mode in args.modes:
        for conc in args.conc:
            rows = [r for r in runs if r["mode"] == mode and r["conc"] == conc]
            to_floor = relative(rows, "floor", "rps", ratio)
            added = relative(rows, "direct", "p50_ms", minus)
            cpu = {n: median_of(rows, n, lambda r: r["cpu_ms_per_req"]) for n in names}
            for name in names:
                cells = [
                    fmt(median_of(rows, name, lambda r: r["rps"]), 0),
                    fmt(median_of(rows, name, to_floor)) + "x",
                    fmt(median_of(rows, name, lambda r: r["p50_ms"])),
                    fmt(median_of(rows, name, lambda r: r["p99_ms"])),
                    fmt(median_of(rows, name, added)),
                    fmt(cpu[name], 3),
                    str(sum(r["error_count"] for r in rows if r["target"] == name)),
                    fmt(median_of(rows, name, lambda r: r["other_cores"])),
                ]
                lines.append(f"| {mode} | {conc} | {name} | " + " | ".join(cells) + " |")
            to_own_floor = relative(rows, "floor http1", "rps", ratio)
            on_its_client = median_of(rows, ours, to_own_floor)
            extra.append(
                f"- {mode} c={conc}: {ours} at {fmt(on_its_client)}x the floor on its own "
                "upstream client (`floor http1`)"
            )
            for step, kind in steps.items():
                if (with_step := cpu.get(step)) is not None and (plain := cpu[ours]) is not None:
                    costs = f"costs {with_step - plain:.3f} ms CPU"
                    extra.append(f"- {mode} c={conc}: a server tool step ({kind} tool, with its "
                                 f"second upstream call) {costs}")  # fmt: skip
            if scaled in names and scaled != ours:
                single = "loopwarden sqlite" if "loopwarden sqlite" in names else ours
                gain = median_of(rows, scaled, relative(rows, single, "rps", ratio))
                extra.append(f"- {mode} c={conc}: 2 workers / 1 ({single}) = {fmt(gain)}x RPS")
    if probes:
        lines += ["", "| TTFT (sequential streams, 2 ms chunk gap) | TTFT p50 ms "
                  "| added TTFT p50 ms | first byte p50 ms |", "|---|---|---|---|"]  # fmt: skip
        added_ttft = relative(probes, "direct", "ttft_p50_ms", minus)
        for name in names:
            if any(p["target"] == name for p in probes):
                cells = [
                    fmt(median_of(probes, name, lambda p: p["ttft_p50_ms"])),
                    fmt(median_of(probes, name, added_ttft)),
                    fmt(median_of(probes, name, lambda p: p["first_byte_p50_ms"])),
                ]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    noise = [r["other_cores"] for r in runs]
    if noise:
        extra.append(f"- other load: the cores that processes outside the benchmark kept busy "
                     f"during a row (median {statistics.median(noise):.2f}, max "
                     f"{max(noise):.2f}); trust the rows where it is near 0")  # fmt: skip
    return "\n".join([*machine(args), "", *lines, *(["", *extra] if extra else [])])


def machine(args: Any) -> list[str]:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    layout = "mock and wrk on CPU 0, floor and Loopwarden on CPU 1" if cores() >= 2 else "one core"
    return [
        f"Machine: {model}, {cores()} cores, Python {platform.python_version()}; floor on "
        f"{args.server}, Loopwarden on its own server (`loopwarden serve`); {layout}.",
        f"Medians of {args.reps} interleaved rep(s) of {args.duration:g} s per row (wrk, closed "
        f"loop); x floor and added p50 (vs direct) are per rep; CPU: the target's process tree.",
    ]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per row and rep")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--conc", type=lambda s: [int(c) for c in s.split(",")], default=[1, 64])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["json", "stream"])
    parser.add_argument("--workers", type=int, default=1, help="Loopwarden's worker processes")
    parser.add_argument("--server", choices=["uvicorn", "granian"], default="uvicorn")
    steps = "add server tool step rows (a sync and an async python tool)"
    parser.add_argument("--tool-step", action="store_true", help=steps)
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="add Loopwarden exporting traces, sampling none and all",
    )
    parser.add_argument("--scaling", action="store_true", help="add Loopwarden on 2 workers")
    parser.add_argument("--wrk-cpus", default="0" if cores() >= 2 else "", help="taskset -c")
    parser.add_argument("--warmup", type=float, default=2.0, help="unrecorded seconds per row")
    parser.add_argument("--ttft", type=int, default=100, help="probe streams per target and rep")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between rows")
    parser.add_argument("--litellm", default="auto", help="auto (if on PATH), off, or a path")
    parser.add_argument("--out", help="write every run as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as folder, running(Path(folder)) as servers:
        targets = start(servers, args)
        args.pids = servers.pids
        runs, probes = measure(targets, args)
    print(report(targets, runs, probes, args))
    if args.out:
        Path(args.out).write_bytes(orjson.dumps({"args": vars(args), "runs": runs, "ttft": probes}))


if __name__ == "__main__":
    main()
