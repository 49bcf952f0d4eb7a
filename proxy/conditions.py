"""Custom stop conditions that run outside the engine: `webhook` and `python` (SPEC §6)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import orjson

from proxy.callables import CallThreads, call, load_callable
from proxy.config.agents import ConditionConfig
from proxy.config.environment import setting
from proxy.deadline import within
from proxy.http_body import read_up_to

log = logging.getLogger(__name__)
# A webhook answers `{"stop": true}` or not: a longer answer is not read, and the check fails.
WEBHOOK_ANSWER_BYTES = 64 * 1024


class ConfiguredChecks:
    """Implements the engine's `ConditionChecks`. A check that fails does not hold."""

    def __init__(
        self,
        conditions: Mapping[str, ConditionConfig],
        client: httpx.AsyncClient,
        threads: CallThreads,
    ) -> None:
        """Webhooks call through `client`, sync python conditions run in `threads`."""
        self.conditions = dict(conditions)
        self.client = client
        self.threads = threads
        self.functions: dict[str, Callable[..., Any]] = {}
        for name, cfg in conditions.items():
            if cfg.kind == "python" and cfg.callable:
                try:
                    self.functions[name] = load_callable(cfg.callable)
                except ValueError as exc:
                    raise ValueError(f"conditions.{name}: {exc}") from None

    async def check(self, kind: str, name: str, snapshot: Mapping[str, Any]) -> bool | None:
        cfg = self.conditions[name]
        try:  # within `timeout_s` as a whole (a webhook that trickles its answer included)
            if kind == "python":  # (`within`: a run cancelled meanwhile is cancelled)
                return await within(self._python(name, snapshot), cfg.timeout_s)
            return await within(self._webhook(cfg, snapshot), cfg.timeout_s)
        except Exception as exc:
            log.warning("stop condition %s %r failed: %s", kind, name, exc)
            return None

    async def _python(self, name: str, snapshot: Mapping[str, Any]) -> bool:
        return bool(await call(self.functions[name], self.threads, dict(snapshot)))

    async def _webhook(self, cfg: ConditionConfig, snapshot: Mapping[str, Any]) -> bool:
        assert cfg.url is not None
        headers = {h: setting(env) or "" for h, env in cfg.headers_env.items()}
        headers["content-type"] = "application/json"
        content = orjson.dumps(dict(snapshot))
        request = self.client.build_request(
            "POST", cfg.url, content=content, headers=headers, timeout=cfg.timeout_s
        )
        response = await self.client.send(request, stream=True)
        try:
            response.raise_for_status()
            body, more = await read_up_to(response, WEBHOOK_ANSWER_BYTES)
        finally:
            await response.aclose()
        if more:
            raise ValueError(f"its answer is larger than {WEBHOOK_ANSWER_BYTES} bytes")
        answer = orjson.loads(body)
        return isinstance(answer, dict) and answer.get("stop") is True
