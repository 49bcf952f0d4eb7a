"""Token usage of a step and of a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _add_details(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            into[key] = into.get(key, 0) + value
        elif isinstance(value, dict):
            _add_details(into.setdefault(key, {}), value)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # prompt_tokens_details / completion_tokens_details as the upstream gave them.
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.total_tokens += other.total_tokens
        _add_details(self.details, other.details)

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        out.update(self.details)
        return out
