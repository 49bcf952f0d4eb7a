"""What a config document gets wrong that its schema cannot tell (names it uses but does not
define, expressions that do not compile), read from the document itself."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from proxy.config.tools import could_expose
from proxy.engine.options import PolicyOptions
from proxy.engine.policy import condition_problems


def _entries(data: dict[str, Any], section: str) -> dict[str, Any]:
    value = data.get(section)
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def reference_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """What a config document names but does not define (and the names it must not repeat),
    read from the document itself so that it is found even where the schema fails. Agents'
    policies are checked when they are compiled against the tools (`proxy.api.planning`)."""
    errors: list[tuple[str, str]] = []
    upstreams = _entries(data, "upstreams") if "upstreams" in data else {"openai": {}}
    default = data.get("default_upstream", "openai")
    if default not in upstreams:
        errors.append(("default_upstream", f"no upstream named {default!r}"))
    models = _entries(data, "models")
    for name, alias in models.items():
        upstream = alias.get("upstream") if isinstance(alias, dict) else None
        if upstream is not None and upstream not in upstreams:
            errors.append((f"models.{name}.upstream", f"no upstream named {upstream!r}"))
    tools = _entries(data, "tools")
    ids: set[str] = set()
    for name, tool in tools.items():
        tool_id = tool.get("id") if isinstance(tool, dict) else None
        if tool_id is not None:
            if tool_id in ids or tool_id in tools:
                errors.append((f"tools.{name}.id", f"id {tool_id!r} is not unique"))
            ids.add(tool_id)
    for name, agent in _entries(data, "agents").items():
        if name in models:
            errors.append((f"agents.{name}", "an agent and a model alias share this name"))
        refs = agent.get("tools") if isinstance(agent, dict) else None
        for i, ref in enumerate(refs if isinstance(refs, list) else []):
            if isinstance(ref, str) and not _known_tool(ref, tools, ids):
                errors.append((f"agents.{name}.tools[{i}]", f"no tool named {ref!r}"))
    auth = _entries(data, "auth")
    errors.extend(_key_problems(auth, tools, ids))
    if auth.get("keys"):
        errors.extend(
            (
                f"upstreams.{name}.forward_client_key",
                "cannot be true while auth.keys are set: the client's key is the proxy's own",
            )
            for name, upstream in upstreams.items()
            if isinstance(upstream, dict) and upstream.get("forward_client_key") is True
        )
    return errors


def _known_tool(ref: str, tools: dict[str, Any], ids: set[str]) -> bool:
    """A tool entry's name or id, or a name that one of its mcp entries could expose."""
    return ref in tools or ref in ids or any(could_expose(t, ref) for t in tools.values())


def _key_problems(
    auth: dict[str, Any], tools: dict[str, Any], ids: set[str]
) -> list[tuple[str, str]]:
    """Keys' names and digests are unique (a key's threads are named by it; a token names one
    caller), the tools they list exist, and a protected `/metrics` has a key that may read it."""
    errors: list[tuple[str, str]] = []
    listed = auth.get("keys")
    keys = listed if isinstance(listed, list) else []
    names: set[str] = set()
    digests: dict[str, int] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, dict):
            continue  # the schema reports it
        name = key.get("name")
        if isinstance(name, str):
            if name in names:
                errors.append((f"auth.keys[{i}].name", f"name {name!r} is not unique"))
            names.add(name)
        digest = key.get("key_sha256")
        if isinstance(digest, str):
            first = digests.setdefault(digest.lower(), i)
            if first != i:
                errors.append((f"auth.keys[{i}].key_sha256", f"the same key as auth.keys[{first}]"))
        refs = key.get("tools")
        for j, ref in enumerate(refs if isinstance(refs, list) else []):
            if isinstance(ref, str) and ref != "*" and not _known_tool(ref, tools, ids):
                errors.append((f"auth.keys[{i}].tools[{j}]", f"no tool named {ref!r}"))
    readers = [k for k in keys if isinstance(k, dict) and k.get("metrics") is True]
    if auth.get("metrics_key") is True and not readers:
        errors.append(("auth.metrics_key", "no key has metrics: true, so none could read /metrics"))
    return errors


def expression_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The problems of the stop conditions of each agent whose `stop_when` has its shape (an
    `expr` that does not compile), for a document the schema fails elsewhere: else they were
    told only once the rest was mended (the wiring that compiles them needs a whole config)."""
    problems: list[tuple[str, str]] = []
    for name, agent in _entries(data, "agents").items():
        entries = agent.get("stop_when") if isinstance(agent, dict) else None
        try:
            options = PolicyOptions.model_validate({"stop_when": entries or []})
        except ValidationError:  # the schema's errors tell it
            continue
        problems += condition_problems(options, f"agents.{name}.")
    return problems
