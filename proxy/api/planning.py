"""Planning a run: which agent and upstream, which tools, and the policy (SPEC §4.1).

Agents' policies are compiled once, here, at start-up (and by `loopwarden check`); a request
only compiles its own `loop` and tightens the agent's policy with it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from proxy.api.auth import Caller, KeyRing, ToolScope, tool_scope
from proxy.api.run_request import RunRequest
from proxy.config import Config, ConfigError
from proxy.config.agents import AgentConfig
from proxy.engine.policy import (
    EMPTY,
    Catalog,
    LoopPolicy,
    check_references,
    compile_policy,
    tighten,
)
from proxy.engine.ports import PriceBook
from proxy.engine.run_spec import RunSpec
from proxy.engine.values import ToolSpec
from proxy.errors import InvalidRequest, PermissionDenied, PolicyInvalid


@dataclass(frozen=True, slots=True)
class Target:
    upstream: str
    model: str


@dataclass(slots=True)
class Plan:
    spec: RunSpec
    upstream: str
    agent: str | None


def new_run_id() -> str:
    return f"run_{secrets.token_hex(12)}"


class Planner:
    """Raises ConfigError, with every problem, for agents whose policy does not compile.

    `groups` maps the name of each MCP entry to the tools it exposes: an agent's or a request's
    `tools` may name the entry for all of them (SPEC §13)."""

    def __init__(
        self,
        config: Config,
        tools: Mapping[str, ToolSpec],
        prices: PriceBook,
        groups: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.config = config
        self.prices = prices
        self.groups = dict(groups or {})
        self.catalog = Catalog(tools, {name: cond.kind for name, cond in config.conditions.items()})
        self.agents: dict[str, LoopPolicy] = {}
        problems: list[tuple[str, str]] = []
        for name, agent in config.agents.items():
            policy, found = self._agent(agent)
            if found:
                problems.extend((f"agents.{name}.{path}", msg) for path, msg in found)
                continue
            self.agents[name] = policy
        if problems:
            raise ConfigError(problems)
        agent_tools = {name: list(policy.tools) for name, policy in self.agents.items()}
        self.tool_scopes: dict[str, ToolScope] = {}
        for key in config.auth.keys:
            scope = tool_scope(key, agent_tools, self.catalog.names)
            listed = [self.groups[ref] for ref in key.tools or () if ref in self.groups]
            if listed and not scope.every:  # a key that lists an MCP entry may use its tools
                scope = ToolScope(scope.names.union(*listed))
            self.tool_scopes[key.name] = scope

    def _agent(self, agent: AgentConfig) -> tuple[LoopPolicy, list[tuple[str, str]]]:
        """An agent's policy, and every problem of it (the first at each path): its tools'
        and its options', then what the policy of the rest refers to and lacks."""
        found: list[tuple[str, str]] = []
        try:
            refs = self.expand(agent.tools, "")
        except PolicyInvalid as exc:
            found.extend(exc.problems)
            refs = self.expand([r for r in agent.tools if self._known(r)], "")
        target = self.target(agent.model)
        policy = compile_policy(agent, refs, self.catalog, found=found)
        try:
            check_references(policy, (), target.model, self._priced(target))
        except PolicyInvalid as exc:
            found.extend(exc.problems)
        first: dict[str, str] = {}
        for path, message in found:
            first.setdefault(path, message)
        return policy, list(first.items())

    def _known(self, ref: str) -> bool:
        return ref in self.groups or ref in self.catalog.names

    def expand(self, refs: Sequence[str], path: str) -> list[str]:
        """`refs` with each MCP entry's name replaced by the tools it exposes; raises
        PolicyInvalid for a name that is neither a tool nor an entry, at its own index."""
        problems = [
            (f"{path}tools[{i}]", f"no server tool named {ref!r}")
            for i, ref in enumerate(refs)
            if not self._known(ref)
        ]
        if problems:
            raise PolicyInvalid(problems)
        if not any(ref in self.groups for ref in refs):
            return list(refs)
        out: list[str] = []
        for ref in refs:
            out.extend(self.groups.get(ref, (ref,)))
        return out

    def target(self, model: str) -> Target:
        alias = self.config.models.get(model)
        if alias is not None:
            return Target(alias.upstream or self.config.default_upstream, alias.model)
        return Target(self.config.default_upstream, model)

    def _priced(self, target: Target) -> Callable[[], bool]:
        def priced() -> bool:
            if self.config.upstreams[target.upstream].reports_cost:
                return True
            return self.prices.prices(target.model) is not None

        return priced

    def agent_name(self, req: RunRequest) -> str | None:
        if req.loop.agent is not None:
            if req.loop.agent not in self.config.agents:
                raise InvalidRequest(f"no agent named {req.loop.agent!r}", param="loop.agent")
            return req.loop.agent
        return req.model if req.model in self.config.agents else None

    def plan(self, req: RunRequest, caller: Caller | None) -> Plan:
        """The run `req` asks for; a key that may not use its agent, or a tool `loop.tools`
        adds, is refused first (403), whether that agent exists or not."""
        if req.loop.agent is not None:
            KeyRing.check(caller, req.loop.agent, "loop.agent")
        name = self.agent_name(req)
        KeyRing.check(caller, name or req.model)
        thread_id = req.thread_id
        if caller is not None:
            self._check_tools(caller, req.loop.tools)
            _check_model_fields(caller, req.params)
            if thread_id is not None and req.client_thread:
                thread_id = caller.scoped(thread_id)
        agent = self.config.agents[name] if name else None
        target = self.target(agent.model if agent else req.model)
        policy = self.agents[name] if name else EMPTY
        client_names = [t["function"]["name"] for t in req.client_tools]
        if req.has_loop:
            try:
                refs = self.expand(req.loop.tools, "loop.")
                own = compile_policy(req.loop, refs, self.catalog, "loop.")
                policy = tighten(policy, own)
                check_references(policy, client_names, target.model, self._priced(target))
            except PolicyInvalid as exc:
                raise PolicyInvalid(
                    [(_param(path), msg) for path, msg in exc.problems], code=exc.code
                ) from None
        for i, client in enumerate(client_names):
            if client in policy.tools:
                raise InvalidRequest(
                    f"tool {client!r} clashes with a server tool",
                    param=req.tool_params[i] if req.tool_params else f"tools[{i}].function.name",
                )
        if isinstance(req.tool_choice, dict):
            _check_choice(req, client_names, policy.tools)
        if (req.has_loop or policy.tools) and (legacy := _legacy_field(req.params)):
            raise InvalidRequest(
                f"{legacy} (the functions API before tools) cannot be used when the proxy runs "
                "a loop: send client tools as tools",
                param=legacy,
            )
        if req.params.get("n", 1) != 1 and (
            req.has_loop or policy.stop_when or policy.may_take_steps
        ):  # a run's reply is one message, and budgets size one completion a step
            raise InvalidRequest("n must be 1 when the proxy runs a loop", param="n")
        spec = RunSpec(
            run_id=new_run_id(),
            model=target.model,
            messages=req.messages,
            policy=policy,
            agent=name,
            system_prompt=agent.system_prompt if agent else None,
            client_tools=req.client_tools,
            client_tool_choice=req.tool_choice,
            max_completion_tokens=req.max_completion_tokens,
            params=req.params,
            thread_id=thread_id,
            max_tool_output=self.config.server.max_run_tool_output_bytes,
        )
        return Plan(spec, target.upstream, name)

    def _check_tools(self, caller: Caller, refs: list[str]) -> None:
        """A tool outside the key's scope is refused the same way whether it exists or not, so
        a key learns nothing of the tools it may not use (a 400 for an unknown tool is left to
        keys that may use every tool)."""
        scope = self.tool_scopes[caller.name]
        for i, ref in enumerate(refs):
            if ref in self.groups:
                allowed = all(scope.allows(name) for name in self.groups[ref])
            else:
                allowed = scope.allows(self.catalog.names.get(ref))
            if not allowed:
                raise PermissionDenied(
                    f"key {caller.name!r} may not use tool {ref!r}",
                    param=f"loop.tools[{i}]",
                    code="tool_not_allowed",
                )


def _check_choice(req: RunRequest, client: list[str], server: Mapping[str, object]) -> None:
    """A `tool_choice` naming a tool must name one the run offers: a client tool or a server
    tool of its policy (the upstream would refuse it after the proxy had begun the run)."""
    choice = req.tool_choice
    if choice.get("type") not in ("function", "custom"):
        return
    kind = choice["type"]
    chosen = choice[kind]["name"]
    if chosen not in server and (kind == "custom" or chosen not in client):
        raise InvalidRequest(
            f"names {chosen[:64]!r}, which is none of the tools offered",
            param=req.choice_param or f"tool_choice.{kind}.name",
        )


def _check_model_fields(caller: Caller, params: Mapping[str, object]) -> None:
    """A key limited to some models may send no other field that names one: `MODEL` (some
    upstreams match field names in any case, and take the later) or OpenRouter's `models`
    (fallbacks the upstream may run instead)."""
    if caller.unrestricted:
        return
    for name in params:
        if name.casefold() in ("model", "models"):  # (as Go folds: U+017F is s, U+212A k)
            raise PermissionDenied(
                f"key {caller.name!r} may use only the models it names: {name[:32]!r} could "
                "name another",
                param=name,
            )


def _legacy_field(params: Mapping[str, object]) -> str | None:
    """A field of the functions API before tools, whose calls would come back to the proxy as
    unknown tools."""
    for name in ("functions", "function_call"):
        if params.get(name) is not None:
            return name
    return None


def _param(path: str) -> str:
    """A path in the agent's own policy is reported under `agent.`; the request's under `loop.`."""
    if path.startswith("loop.") or path == "model":
        return path
    return f"agent.{path}"
