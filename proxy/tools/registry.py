"""The server tools, and the executor the engine calls: each call's arguments checked, then
run within its timeout. The tools of MCP sources come and go with their servers' lists: the
registry is rebuilt from them on every change, each named as its source offers it (built from
the config by `proxy.tools.building`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from proxy import exact_json
from proxy.callables import CallRaised, NoWorkerFree
from proxy.config.tools import (
    FUNCTION_NAME,
    digest_name,
    might_expose,
    offered_prefix,
)
from proxy.deadline import within
from proxy.engine.values import ToolCall, ToolContext, ToolOutcome, ToolResult, ToolSpec
from proxy.json_values import MAX_DEPTH, holds_over, nests_too_deep
from proxy.redaction import redacted
from proxy.throttled_log import ThrottledWarnings
from proxy.tools.base import Tool, ToolFailed, as_text, output_too_large
from proxy.tools.mcp_source import McpSource
from proxy.tools.mcp_tool import CallHook, exposed_tool, unavailable_tool
from proxy.tools.schema import SchemaCheck

log = logging.getLogger(__name__)


class SourcesUnavailable(RuntimeError):
    """Start-up cannot go on: a required MCP source did not connect, or the sources' tools do
    not fit the config."""


class ToolRegistry:
    """Runs server tools. Tool failures become error results, never exceptions.

    `tools` holds the config's own tools, the tools the MCP `sources` expose now, and, for each
    name the config uses (`references`) that a source could expose but does not now, a stand-in
    whose calls are tool errors, so that agents naming it still compile. `groups` maps each
    source's entry name to the names it stands for. `listeners` are called after every change.
    `server_references` are the names that must be server tools (not client tools).
    """

    def __init__(
        self,
        tools: Mapping[str, Tool],
        sources: Iterable[McpSource] = (),
        references: Iterable[str] = (),
        server_references: Iterable[str] = (),
        default_max_output_bytes: int = 1024 * 1024,
        on_call: CallHook | None = None,
        max_argument_values: int = 100_000,
    ) -> None:
        """`max_argument_values`: the most JSON values a call's arguments may hold, counted
        before they are parsed on the event loop (`server.max_body_values`)."""
        self.static = dict(tools)
        self.sources = {source.name: source for source in sources}
        self.references = sorted(set(references) - set(self.static))
        self.server_references = frozenset(server_references)
        self.default_max_output_bytes = default_max_output_bytes
        self.on_call = on_call
        self.max_argument_values = max_argument_values
        self.listeners: list[Callable[[], None]] = []
        self.tools: dict[str, Tool] = dict(tools)
        # Each tool's failures, told in the log once a second (the model reads each one).
        self._failures: dict[str, ThrottledWarnings] = {}
        self.groups: dict[str, tuple[str, ...]] = {}
        self.stand_ins: frozenset[str] = frozenset()
        # What the last lists did not fit: tools left out (over `max_tools`, a schema that is
        # none, a name listed twice), logged; and `clashes`, names two sources (or a source and
        # the config) expose, which fail start-up (SPEC §13).
        self.problems: list[str] = []
        self.clashes: list[str] = []
        for source in self.sources.values():
            source.listeners.append(self._changed)
        self.refresh()

    def spec(self, name: str) -> ToolSpec:
        return self.tools[name].spec

    def specs(self) -> dict[str, ToolSpec]:
        return {name: tool.spec for name, tool in self.tools.items()}

    def refresh(self) -> None:
        """Rebuilds `tools` and `groups` from the sources' lists as they are now. A name keeps
        the source that had it: a clash that appears later (a server adds a tool another one
        offers already) leaves the newcomer out, whatever the order of the config (else a
        server could take another's tool, and the calls meant for it)."""
        had = {name: tool.spec.source for name, tool in self.tools.items()}
        tools = dict(self.static)
        problems: list[str] = []
        clashes: list[str] = []
        offers = [offer for source in self.sources.values() for offer in _offers(source, problems)]
        ranked = sorted(offers, key=lambda offer: had.get(offer[2]) != offer[0].name)
        taken: set[int] = set()  # of the offers, by id
        exposing: dict[str, int] = dict.fromkeys(self.sources, 0)  # tools, by source
        for source, listed, exposed in ranked:
            if exposing[source.name] >= source.cfg.max_tools:
                if exposing[source.name] == source.cfg.max_tools:  # told once
                    exposing[source.name] += 1
                    problems.append(
                        f"tools.{source.name}: more than max_tools ({source.cfg.max_tools})"
                        f" tools; {exposed!r} and later ones are left out"
                    )
                continue
            clash = tools.get(exposed)
            if clash is not None:
                owner = f"MCP server {clash.spec.source!r}" if clash.spec.source else "the config"
                clash_of = f"tools.{source.name}: {exposed!r} is also a tool of {owner}"
                problems.append(clash_of)
                clashes.append(clash_of)
                continue
            try:
                tools[exposed] = exposed_tool(
                    source, listed, exposed, self.default_max_output_bytes, self.on_call
                )
            except (ValueError, RecursionError) as exc:  # (one tool: the others stay)
                why = exc if isinstance(exc, ValueError) else "nested too deeply"
                problems.append(f"tools.{source.name}: tool {listed.name!r}: {why}; it is left out")
                continue
            taken.add(id(listed))
            exposing[source.name] += 1
        groups: dict[str, list[str]] = {source: [] for source in self.sources}
        for source, listed, exposed in offers:  # each source's tools in the order it lists them
            if id(listed) in taken:
                groups[source.name].append(exposed)
        stand_ins = set()
        for name in self.references:
            claimant = self._claimant(name) if name not in tools else None
            if claimant is not None:
                tools[name] = unavailable_tool(claimant, name, self.default_max_output_bytes)
                if not claimant.listed:  # the entry may stand for it: nothing says otherwise yet
                    groups[claimant.name].append(name)
                stand_ins.add(name)
        told = set(self.problems)
        for problem in problems:
            if problem not in told:
                log.error("%s", problem)
        self.tools = tools
        self.groups = {name: tuple(names) for name, names in groups.items()}
        self.stand_ins = frozenset(stand_ins)
        self.problems = problems
        self.clashes = clashes

    def _claimant(self, name: str) -> McpSource | None:
        for source in self.sources.values():
            cfg = source.cfg
            if might_expose(cfg.prefix or "", cfg.include, list(cfg.exclude), name):
                return source
        return None

    def _changed(self, source: McpSource) -> None:
        self.refresh()
        for listener in list(self.listeners):
            listener()

    async def open(self) -> None:
        """Connects every source; returns when each has connected or failed once."""
        await asyncio.gather(*(source.start() for source in self.sources.values()))

    async def close(self) -> None:
        await asyncio.gather(*(source.close() for source in self.sources.values()))

    def missing(self) -> list[McpSource]:
        """The sources not connected now."""
        return [s for s in self.sources.values() if not s.connected]

    def check_started(self) -> None:
        """Raises SourcesUnavailable, naming each problem, when a required source is not
        connected, the sources' tools clash, or a name the config uses is not exposed by the
        connected source it belongs to. (A source's tools left out are logged: it starts.)"""
        problems = list(self.clashes)
        for source in self.missing():
            if source.cfg.required:
                problems.append(
                    f"tools.{source.name}: required {source.located()} did not connect:"
                    f" {source.error or 'no answer'}"
                )
        for name in sorted(self.stand_ins & self.server_references):
            source = self.sources[self.tools[name].spec.source or ""]
            if source.connected:
                offered = ", ".join(self.groups[source.name][:50]) or "none"
                problems.append(
                    f"tools.{source.name}: the config names {name!r}, which"
                    f" {source.located()} does not expose (it exposes: {offered})"
                )
        if problems:
            raise SourcesUnavailable("\n".join(problems))

    async def check(self, call: ToolCall) -> dict[str, Any] | str:
        """The arguments of `call` checked against its tool's schema, or why it cannot run as
        asked (a tool it does not have, arguments that are no JSON object or do not match)."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r}"
        return await _checked_arguments(tool, call, self.max_argument_values)

    async def execute(
        self, call: ToolCall, ctx: ToolContext, arguments: dict[str, Any] | None = None
    ) -> ToolResult:
        checked = arguments if arguments is not None else await self.check(call)
        if isinstance(checked, str):
            return ToolResult(checked, ToolOutcome.ERROR)
        tool = self.tools.get(call.name)
        if tool is None:  # gone since it was checked (a source's new list)
            return ToolResult(f"unknown tool {call.name!r}", ToolOutcome.ERROR)
        try:
            output = await within(tool.invoke(checked, ctx), tool.timeout_s + tool.grace_s)
            text = as_text(output)
        except TimeoutError:
            result = ToolResult(f"tool timed out after {tool.timeout_s:g}s", ToolOutcome.TIMEOUT)
            return self._told(call.name, result)
        except (ToolFailed, NoWorkerFree, CallRaised) as exc:
            return self._told(call.name, _failed(str(exc), tool.max_output_bytes))
        except Exception as exc:
            failed = _failed(f"{type(exc).__name__}: {exc}", tool.max_output_bytes)
            return self._told(call.name, failed)
        if not text.isascii():
            text = _encodable(text)
        # Characters are at most 4 bytes: only a long text needs encoding to be measured.
        if len(text) * 4 > tool.max_output_bytes and len(text.encode()) > tool.max_output_bytes:
            return ToolResult(str(output_too_large(tool.max_output_bytes)), ToolOutcome.ERROR)
        return ToolResult(text)

    def _told(self, name: str, result: ToolResult) -> ToolResult:
        """`result`, a failure, told in the log: once a second a tool, with a count of the
        others (an operator's only record of why a tool fails, its spans saying `tool_error`)."""
        told = self._failures.get(name)
        if told is None:
            told = self._failures[name] = ThrottledWarnings(log)
        told.warning("tool %s failed: %s", name, result.output[:300].replace("\n", " "))
        return result


# The most characters a call's arguments may hold: more than any model writes in one reply
# (~250,000 tokens), and what the event loop parses in some 25 ms at worst.
MAX_ARGUMENT_CHARS = 1024 * 1024


async def _checked_arguments(tool: Tool, call: ToolCall, max_values: int) -> dict[str, Any] | str:
    """The arguments of `call` checked against `tool`'s schema, or why they are refused."""
    raw = call.arguments
    if len(raw) > MAX_ARGUMENT_CHARS:  # parsed on the event loop: bounded before
        return f"arguments of more than {MAX_ARGUMENT_CHARS} characters"
    if len(raw) > max_values and await holds_over(raw.encode(), max_values):
        return f"arguments hold more than {max_values} JSON values (server.max_body_values)"
    try:
        arguments = exact_json.loads(call.arguments or "{}")
    except (ValueError, RecursionError) as exc:
        return f"arguments are not valid JSON: {exc}"
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    if nests_too_deep(call.arguments, arguments):  # no message or record could hold them
        return f"arguments nest deeper than {MAX_DEPTH} levels"
    try:
        validate = tool.validate
        if isinstance(validate, SchemaCheck) and validate.needs_thread(len(call.arguments)):
            return await validate.in_thread(arguments)  # patterns, references, long
        return validate(arguments)
    except ToolFailed as exc:
        return str(exc)
    except Exception as exc:  # a check's own failure refuses the call: it never runs unchecked
        return f"the arguments could not be checked: {type(exc).__name__}"


REDACTED_CHARS = 64 * 1024  # of an error's text, the most read for secrets and given


def _failed(message: str, cap: int) -> ToolResult:
    """An error result: its text (an exception's, an MCP server's) without what looks like a
    credential (a database URL's password), cut to `cap` bytes (REDACTED_CHARS at most)."""
    # Redacted before it is cut (a cut between a password and its `@` would show the password),
    # and no more of it than the cap and a little: the patterns run on the event loop.
    cap = min(cap, REDACTED_CHARS)
    message = _encodable(redacted(message[: cap + 512]))
    if len(message) * 4 > cap and len(encoded := message.encode()) > cap:
        message = encoded[: cap - 3].decode("utf-8", "ignore") + "…"
    return ToolResult(message, ToolOutcome.ERROR)


def _encodable(text: str) -> str:
    """`text` with the lone surrogates (a file name `os.listdir` could not decode) that no
    UTF-8 message can carry replaced."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode()
    return text


def _offers(source: McpSource, problems: list[str]) -> list[tuple[McpSource, Any, str]]:
    """The tools a source offers, each with the name it is offered under, in its list's order
    (a name listed twice once; the problems told in `problems`)."""
    offered = [(listed, source.cfg.exposed_name(listed.name)) for listed in source.tools]
    prefix = source.cfg.prefix or ""
    start = offered_prefix(source.cfg.prefix)
    # Names a server's tools are offered under as they are (after the prefix): a name made of
    # another (`a.b` as `a_b`) never takes one of them, nor one another made name took.
    own = {name for listed, name in offered if name is not None and _as_is(start, listed, name)}
    names: set[str] = set()
    offers: list[tuple[McpSource, Any, str]] = []
    for listed, exposed in offered:
        if exposed is None:
            continue
        if not _as_is(start, listed, exposed) and (exposed in own or exposed in names):
            exposed = digest_name(prefix + listed.name)
        if exposed in names:
            problems.append(
                f"tools.{source.name}: {exposed!r} is listed twice; the second is left out"
            )
            continue
        names.add(exposed)
        offers.append((source, listed, exposed))
    return offers


def _as_is(start: str, listed: Any, name: str) -> bool:
    """Whether a server's tool is offered as `name` under its own name, after the prefix."""
    return bool(FUNCTION_NAME.match(listed.name)) and name == start + listed.name
