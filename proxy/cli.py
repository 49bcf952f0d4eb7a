"""`loopwarden serve | check | tools | demo` (SPEC §3, §13)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from proxy import __version__
from proxy.config import Config, ConfigError, load_config
from proxy.config.environment import environment_problems, unset_keys, unset_variables

if TYPE_CHECKING:
    from proxy.api.app import ProxyApp
    from proxy.state.sqlite_file import FileIdentity


def needs_environment(config: Config) -> None:
    """Raises ConfigError naming every variable the config needs that is not set, and every
    one it sends in a header that cannot be sent."""
    problems = environment_problems(config)
    if problems:
        raise ConfigError(problems)


@contextlib.contextmanager
def _set_for_now(variables: dict[str, str]) -> Iterator[None]:
    """The environment with `variables` set while the block runs, as it was after."""
    before = {variable: os.environ.get(variable) for variable in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for variable, value in before.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def _report(exc: ConfigError) -> None:
    for where, message in exc.problems:
        print(f"{where}: {message}", file=sys.stderr)


def _check(path: str | None) -> int:
    try:
        config = load_config(path)
    except ConfigError as exc:
        _report(exc)
        return 1
    problems = environment_problems(config)
    _report(ConfigError(problems))
    for where, variable in unset_keys(config):  # told, not refused: a local server needs none
        print(f"{where}: note: {variable} is not set: no key is sent", file=sys.stderr)
    wrong = _wiring_problems(config, unset_variables(config))
    for line in wrong:
        print(line, file=sys.stderr)
    if problems or wrong:
        return 1
    print("config OK")
    return 0


def _wiring_problems(config: Config, unset: Sequence[tuple[str, str]] = ()) -> list[str]:
    """What wiring the config's services finds wrong (a rule that names no tool, a python tool
    that cannot be imported, a schema that is none), as lines; as if the `unset` variables
    were set, so that every problem is told in one go. The state backend is not opened:
    `serve` does (and `/readyz` checks it)."""
    from proxy.api.wiring import build_services
    from proxy.state.memory import MemoryStore
    from proxy.upstream.http1_transport import Http1Transport

    try:
        with _set_for_now({variable: f"unset {variable}" for _, variable in unset}):
            build_services(config, httpx.AsyncClient(), Http1Transport(), MemoryStore())
    except ConfigError as exc:
        return [f"{where}: {message}" for where, message in exc.problems]
    except ValueError as exc:
        return [str(exc)]
    return []


def _serving_problems(config: Config) -> list[str]:
    """What would stop the proxy as it starts: the wiring's problems, a sqlite file that
    cannot be opened, tracing settings that cannot be; told before it serves, once (not in a
    traceback of each worker)."""
    from proxy.state.backend import check_state
    from proxy.telemetry.setup import exporter_kind

    problems = _wiring_problems(config)
    try:
        check_state(config.state)
    except ValueError as exc:
        problems.append(str(exc))
    try:
        exporter_kind(os.environ)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def _tools(path: str | None) -> int:
    """Connects the MCP sources and prints every server tool with its schema."""
    import asyncio

    try:
        config = load_config(path)
    except ConfigError as exc:
        _report(exc)
        return 1
    return asyncio.run(_list_tools(config))


async def _list_tools(config: Config) -> int:
    from proxy.callables import CallThreads
    from proxy.tools.building import build_registry

    try:
        registry = build_registry(config, httpx.AsyncClient(), CallThreads(1))
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    await registry.open()
    try:
        failed = 0
        for source in registry.missing():
            failed += 1
            print(f"tools.{source.name}: {source.located()}: {source.error}", file=sys.stderr)
        for problem in registry.problems:
            print(problem, file=sys.stderr)
        for name, tool in registry.tools.items():
            if name in registry.stand_ins:
                continue
            function = tool.spec.definition["function"]
            origin = f"mcp: {tool.spec.source}" if tool.spec.source else config.tools[name].kind
            flags = ", terminal" if tool.spec.terminal else ""
            print(f"{name}  ({origin}{flags})")
            if function.get("description"):
                print(f"  {function['description']}")
            schema = json.dumps(function["parameters"], indent=2, sort_keys=True)
            print("\n".join(f"  {line}" for line in schema.splitlines()))
        return 1 if failed or registry.problems else 0
    finally:
        await registry.close()


def _serve(path: str | None, overrides: dict[str, Any]) -> int:
    from proxy.api.server import serve

    try:
        config = load_config(path)
        changes = {name: value for name, value in overrides.items() if value is not None}
        if changes:
            config = config.with_server(**changes)
        needs_environment(config)
    except ConfigError as exc:
        _report(exc)
        return 1
    problems = _serving_problems(config)
    if problems:
        for line in problems:
            print(line, file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # One line per upstream or MCP exchange is noise, and an MCP server's URL may hold a token.
    for noisy in ("httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    server = config.server
    with contextlib.ExitStack() as sockets:
        try:
            probes = _bind(sockets, "probe_port", server.host, server.probe_port)
            listening = _bind(sockets, "port", server.host, server.port)
        except OSError:
            return 1
        assert listening is not None  # a port is always configured
        if server.workers > 1:
            from proxy.api.workers import supervise
            from proxy.state.backend import state_file

            opened = state_file(config.state)  # each worker, a replacement too, opens this one

            def work(sock: socket.socket) -> bool:
                try:
                    app = _app(config, opened)
                except ValueError as exc:  # did not start: no worker is started again
                    print(str(exc), file=sys.stderr)
                    return False
                return serve(app, server, sock, probes, False, app.shutdown)

            return supervise(server.workers, listening, work)
        from proxy.api.workers import metrics_directory
        from proxy.telemetry.metrics import MULTIPROC_ENV

        if os.environ.get(MULTIPROC_ENV):  # one process in multiprocess mode all the same
            metrics_directory()  # emptied of what a process before this one left
        try:
            app = _app(config)
        except ValueError as exc:  # telemetry settings from the environment
            print(str(exc), file=sys.stderr)
            return 1
        return 0 if serve(app, server, listening, probes, shutdown=app.shutdown) else 1


def _bind(
    sockets: contextlib.ExitStack, setting: str, host: str, port: int | None
) -> socket.socket | None:
    """A listening socket on host:port, closed with `sockets` (None without a port); says why,
    naming the setting, when it cannot be had (in use, an address not of this host, a name
    that does not resolve)."""
    from proxy.api.workers import listen

    if port is None:
        return None
    try:
        return sockets.enter_context(listen(host, port))
    except OSError as exc:
        print(f"server.{setting}: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        raise


def _app(config: Config, state_file: FileIdentity | None = None) -> ProxyApp:
    from proxy.api.app import create_app

    return create_app(config, state_file=state_file)


def importable_here() -> None:
    """Python tools (`callable: mytools.text:word_count`) may be imported from the working
    directory, as `python -m proxy` imports them (a script has its own directory on the path,
    not the one it runs in). After every other place: a folder of the working directory never
    stands in for an installed package (an `mcp/` of one's own, or what another user left in
    /tmp). Not with `PYTHONSAFEPATH`."""
    here = os.getcwd()
    if not sys.flags.safe_path and here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="loopwarden",
        description="An OpenAI-compatible gateway that runs the tool loop on the server "
        "(see README.md).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    config_help = (
        "the YAML config (default: $LOOPWARDEN_CONFIG, else the built-in default: OpenAI keyed "
        "by $OPENAI_API_KEY, no server tools)"
    )
    serve = sub.add_parser("serve", help="serve the proxy", description="Serve the proxy.")
    serve.add_argument("--config", metavar="PATH", help=config_help)
    serve.add_argument("--host", help="the address to listen on (default: server.host)")
    serve.add_argument("--port", type=int, help="the port to listen on (default: server.port)")
    serve.add_argument("--workers", type=int, help="worker processes (default: server.workers)")
    serve.add_argument("--probe-port", type=int, help="a listener for probes and scrapes only")
    check = sub.add_parser(
        "check",
        help="validate a config file",
        description="Validate a config: every error with its path; exit 1 if any.",
    )
    check.add_argument("--config", metavar="PATH", help=config_help)
    tools = sub.add_parser(
        "tools",
        help="connect the MCP sources and list every server tool",
        description="Connect the config's MCP sources and list every server tool.",
    )
    tools.add_argument("--config", metavar="PATH", help=config_help)
    sub.add_parser(
        "demo",
        help="run sample runs against a scripted model, offline",
        description="Start the proxy with an embedded config, a scripted model, example tools "
        "and an MCP server (no keys, no network), make nine sample runs, and print each one's "
        "set-up, answer, stop reason and span tree, then the metrics that changed.",
    )
    args = parser.parse_args(argv)
    importable_here()
    if args.command == "serve":
        server = {"host": args.host, "port": args.port, "workers": args.workers}
        return _serve(args.config, {**server, "probe_port": args.probe_port})
    if args.command == "check":
        return _check(args.config)
    if args.command == "tools":
        return _tools(args.config)
    from proxy.demo.runner import main as demo

    return demo()
