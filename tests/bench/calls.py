"""Python function calls a request costs the serving process: a figure the host's noise does not
move, for comparing two versions when CPU times differ by less than two identical processes do
(on a shared VM, two processes of the same code differ by up to ~10 % CPU per request).

    python -m tests.bench.calls [--requests N] [--against PATH] [--top K]

`loopwarden serve` (the bench config: memory state, a python tool) runs against the bench mock,
and is profiled (cProfile, in the serving process) while it answers N requests of each kind in
a row on one kept-alive connection, after a warm-up. Two runs of the same code differ by about
1 %. With `--against PATH` (a checkout of another version, e.g. from `git worktree add`), the
same is measured with PATH first on the server's `PYTHONPATH`, and the functions whose calls
per request differ most are listed.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import pstats
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from proxy.demo.runner import free_port
from tests.bench.load import chat_body
from tests.bench.processes import ROOT, loopwarden_config, running

# The kinds of request measured: (name, model, stream); the agent's tool step is a second
# upstream call and a python tool's.
Kind = tuple[str, str, bool]
KINDS: tuple[Kind, ...] = (
    ("JSON", "mock", False),
    ("SSE", "mock", True),
    ("tool step", "bench-agent-async", False),
)
Counts = collections.Counter[str]
WARMUP = 50  # requests before the profiler starts: connections made, caches filled
# `python -c PROFILED OUT ARGS...`: `python -m proxy ARGS...`, profiled between a SIGUSR1 and a
# SIGUSR2, which writes the profile to OUT (and OUT.on says the profiler is on).
PROFILED = """
import cProfile, os, pathlib, runpy, signal, sys
out, sys.argv = sys.argv[1], ["proxy", *sys.argv[2:]]
profile = cProfile.Profile()
def on(*_):
    profile.enable()
    pathlib.Path(out + ".on").touch()
def off(*_):
    profile.disable()
    profile.snapshot_stats = lambda: snapshot(profile)
    profile.dump_stats(out + ".part")
    os.replace(out + ".part", out)
def snapshot(profile):
    # cProfile's own keeps one entry per (file, line, name): the code objects that share one
    # (every dataclass's __init__ is "<string>", line 2) would count as the last of them alone.
    from cProfile import label
    stats, callers = {}, {}
    def add(into, key, nc, cc, tt, ct):
        was = into.get(key, (0, 0, 0.0, 0.0))
        into[key] = (was[0] + nc, was[1] + cc, was[2] + tt, was[3] + ct)
    for entry in profile.getstats():
        key = label(entry.code)
        add(stats, key, entry.callcount - entry.reccallcount, entry.callcount,
            entry.inlinetime, entry.totaltime)
        for sub in entry.calls or ():
            add(callers.setdefault(label(sub.code), {}), key, sub.callcount,
                sub.callcount - sub.reccallcount, sub.inlinetime, sub.totaltime)
    profile.stats = {k: (*v, callers.get(k, {})) for k, v in stats.items()}
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
runpy.run_module("proxy", run_name="__main__")
"""


def requests(conn: http.client.HTTPConnection, model: str, stream: bool, times: int) -> None:
    """`times` chat requests in a row on `conn`, each read to its end."""
    body, headers = chat_body(model, stream), {"content-type": "application/json"}
    for _ in range(times):
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = conn.getresponse()
        answer = response.read()
        if response.status != 200:
            raise RuntimeError(f"{model}: {response.status} {answer[:200]!r}")


def per_request(folder: Path, mock: str, tree: Path, kind: Kind, n: int) -> dict[str, float]:
    """Calls per function per request of `kind`, by a server running `tree`'s code: `n`
    requests in a row on one kept-alive connection, after WARMUP of them."""
    _, model, stream = kind
    port = free_port()
    out = folder / f"profile-{port}.prof"
    config = folder / f"loopwarden-{port}.yaml"
    config.write_text(yaml.safe_dump(loopwarden_config(mock, folder, False, {}), sort_keys=False))
    serve = ["serve", "--config", str(config), "--port", str(port)]
    argv = [sys.executable, "-c", PROFILED, str(out), *serve]
    with running(folder) as servers:
        servers.start(argv, f"http://127.0.0.1:{port}/healthz", PYTHONPATH=f"{tree}:{ROOT}")
        server = servers.started[-1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            requests(conn, model, stream, WARMUP)
            server.send_signal(signal.SIGUSR1)
            _appears(Path(f"{out}.on"))
            requests(conn, model, stream, n)
            server.send_signal(signal.SIGUSR2)
            _appears(out)
        finally:
            conn.close()
    return {f: calls / n for f, calls in by_function(out, tree).items()}


def _appears(path: Path, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() or (not path.stat().st_size and path.suffix != ".on"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not write {path}")
        time.sleep(0.01)


def by_function(path: Path, tree: Path) -> Counts:
    """Calls per function, named by its file relative to the tree it came from."""
    counts: Counts = collections.Counter()
    prefix = re.compile(rf"^({re.escape(str(tree))}|{re.escape(str(ROOT))})/")
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    for (filename, _, name), (_, calls, *_) in stats.items():
        if filename == "~":  # a builtin: its name says which; one object's address aside
            name = re.sub(r" at 0x[0-9a-f]+", "", name)
        counts[f"{prefix.sub('', filename)}:{name}"] += calls
    return counts


def measure(args: argparse.Namespace) -> str:
    trees = [("this", ROOT), *([("against", args.against.resolve())] if args.against else [])]
    lines = ["| request | " + " | ".join(f"calls/request, {n}" for n, _ in trees) + " |"]
    lines.append("|---" * (len(trees) + 1) + "|")
    details = []
    with tempfile.TemporaryDirectory() as tmp, running(Path(tmp)) as servers:
        mock, _ = servers.mock("")
        for kind in KINDS:
            counts = [per_request(Path(tmp), mock, tree, kind, args.requests) for _, tree in trees]
            totals = [f"{sum(c.values()):,.0f}" for c in counts]
            lines.append(f"| {kind[0]} | " + " | ".join(totals) + " |")
            if len(counts) == 2:
                details.append(differences(kind[0], counts[0], counts[1], args.top))
    return "\n".join([*lines, *details])


def differences(kind: str, this: dict[str, float], other: dict[str, float], top: int) -> str:
    changed = sorted(
        this.keys() | other.keys(), key=lambda f: -abs(this.get(f, 0) - other.get(f, 0))
    )
    rows = [f"\n{kind}: the functions whose calls per request differ most (this - against)"]
    for f in changed[:top]:
        diff = this.get(f, 0) - other.get(f, 0)
        if abs(diff) >= 0.5:
            rows.append(f"  {diff:+8.1f}  {other.get(f, 0):8.1f} -> {this.get(f, 0):8.1f}  {f}")
    return "\n".join(rows)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="N: requests per kind")
    parser.add_argument("--against", type=Path, help="a checkout of another version")
    parser.add_argument("--top", type=int, default=15, help="differing functions listed")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    print(measure(parse(argv)))


if __name__ == "__main__":
    main()
