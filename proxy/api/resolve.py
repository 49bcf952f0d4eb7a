"""From a parsed request and the config to a run: agent, upstream, tools and policy."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace

from proxy.api.chat_request import ChatRequest
from proxy.config import Config
from proxy.engine.policies.stop_conditions import Condition, custom_names, named_tools, walk
from proxy.engine.policies.terminal import TerminatingConfig
from proxy.engine.policies.tool_call_limits import validate_limits
from proxy.engine.policies.tool_rules import RuleBook
from proxy.engine.policy import LoopPolicy
from proxy.engine.ports import PriceBook, ToolSpec
from proxy.engine.run import RunSpec
from proxy.errors import InvalidRequest, SpecError


@dataclass(frozen=True, slots=True)
class Target:
    upstream: str
    model: str


@dataclass(slots=True)
class Resolved:
    spec: RunSpec
    upstream: str
    agent: str | None


def new_run_id() -> str:
    return f"run_{secrets.token_hex(12)}"


class Resolver:
    def __init__(self, config: Config, tools: Mapping[str, ToolSpec], prices: PriceBook) -> None:
        self.config = config
        self.tools = tools
        self.prices = prices
        self.agent_conditions = {n: tuple(a.conditions()) for n, a in config.agents.items()}
        self.agent_terminating = {n: a.terminating() for n, a in config.agents.items()}
        self.agent_rules = {n: a.rules() for n, a in config.agents.items()}
        self.agent_limits = {n: a.limits() for n, a in config.agents.items()}
        self.tool_names = config.tool_names()
        self.agent_tools = {
            n: tuple(self.tool_names.get(t, t) for t in a.tools) for n, a in config.agents.items()
        }

    def target(self, model: str) -> Target:
        alias = self.config.models.get(model)
        if alias is not None:
            return Target(alias.upstream or self.config.default_upstream, alias.model)
        return Target(self.config.default_upstream, model)

    def agent_name(self, req: ChatRequest) -> str | None:
        if req.loop.agent is not None:
            if req.loop.agent not in self.config.agents:
                raise InvalidRequest(f"no agent named {req.loop.agent!r}", param="loop.agent")
            return req.loop.agent
        return req.model if req.model in self.config.agents else None

    def resolve(self, req: ChatRequest, thread_header: str | None) -> Resolved:
        name = self.agent_name(req)
        agent = self.config.agents.get(name) if name else None
        target = self.target(agent.model if agent else req.model)
        tools = self._tools(name, req)
        client_names = {t["function"]["name"] for t in req.tools}
        for i, tool in enumerate(req.tools):
            if tool["function"]["name"] in tools:
                raise InvalidRequest(
                    f"tool {tool['function']['name']!r} clashes with a server tool",
                    param=f"tools[{i}].function.name",
                )
        stop_when = (self.agent_conditions[name] if name else ()) + tuple(req.loop.stop_when)
        self._check_conditions(stop_when, set(tools) | client_names, target)
        terminating = self._terminating(name, req, tools)
        rules = (self.agent_rules[name] if name else ()) + req.loop.tool_rules
        limits = (self.agent_limits[name] if name else ()) + req.loop.tool_call_limits
        try:
            RuleBook(rules).validate(set(tools) | client_names)
            validate_limits(limits, tools)
        except SpecError as exc:
            raise InvalidRequest(exc.message, param=_param(exc.param or "")) from None
        max_steps = _tighter(agent.max_steps if agent else None, req.loop.max_steps)
        policy = LoopPolicy(
            tools=tools,
            stop_when=stop_when,
            max_steps=max_steps,
            terminating=terminating,
            tool_rules=rules,
            tool_call_limits=limits,
            final_answer=bool(req.loop.final_answer or (agent and agent.final_answer)),
            parallel_tool_calls=_first(
                req.loop.parallel_tool_calls, agent.parallel_tool_calls if agent else False
            ),
        )
        if tools and req.params.get("n", 1) != 1:
            raise InvalidRequest("n must be 1 when the server runs tools", param="n")
        spec = RunSpec(
            run_id=new_run_id(),
            model=target.model,
            messages=req.messages,
            policy=policy,
            agent=name,
            system_prompt=agent.system_prompt if agent else None,
            client_tools=req.tools,
            client_tool_choice=req.tool_choice,
            max_completion_tokens=req.max_completion_tokens,
            params=req.params,
            thread_id=req.loop.thread_id or thread_header,
        )
        return Resolved(spec, target.upstream, name)

    def _tools(self, agent: str | None, req: ChatRequest) -> dict[str, ToolSpec]:
        names = list(self.agent_tools[agent]) if agent else []
        for i, ref in enumerate(req.loop.tools):
            resolved = self.tool_names.get(ref)
            if resolved is None:
                raise InvalidRequest(f"no server tool named {ref!r}", param=f"loop.tools[{i}]")
            names.append(resolved)
        return {n: self.tools[n] for n in dict.fromkeys(names)}

    def _terminating(
        self, agent: str | None, req: ChatRequest, tools: Mapping[str, ToolSpec]
    ) -> TerminatingConfig | None:
        base = self.agent_terminating.get(agent) if agent else None
        asked = req.loop.terminating
        if asked is None:
            config, path = base, "terminating_config"
        else:
            path = "loop.terminating_config"
            config = asked
            if base is not None:  # a request tightens the agent's numbers, never loosens them
                config = replace(
                    asked,
                    consecutive_nudges=min(asked.consecutive_nudges, base.consecutive_nudges),
                    max_invocations=min(asked.max_invocations, base.max_invocations),
                )
        if config is None:
            return None
        names = []
        for i, ref in enumerate(config.tool_ids):
            name = self.tool_names.get(ref)
            if name is None or name not in tools:
                raise InvalidRequest(
                    f"{ref!r} is not a server tool enabled for this run",
                    param=f"{path}.tool_ids[{i}]",
                )
            names.append(name)
        return replace(config, tool_ids=tuple(names))

    def _check_conditions(
        self, conditions: tuple[Condition, ...], enabled: set[str], target: Target
    ) -> None:
        for tool, path in named_tools(conditions):
            if tool not in enabled:
                raise InvalidRequest(f"{tool!r} is not a tool of this run", param=_param(path))
        for kind, name, path in custom_names(conditions):
            cfg = self.config.conditions.get(name)
            if cfg is None or cfg.kind != kind:
                raise InvalidRequest(f"no {kind} condition named {name!r}", param=_param(path))
        if (
            any(c.kind == "max_cost" for c in walk(conditions))
            and self.prices.prices(target.model) is None
        ):
            upstream = self.config.upstreams[target.upstream]
            if not upstream.reports_cost:
                raise InvalidRequest(
                    f"a cost condition is set but model {target.model!r} has no known price; "
                    "add it to `pricing` or use an upstream that reports cost",
                    param="model",
                    code="unknown_model_price",
                )


def _param(path: str) -> str:
    return path if path.startswith("loop.") else f"agent.{path}"


def _tighter(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def _first(value: bool | None, default: bool) -> bool:
    return default if value is None else value
