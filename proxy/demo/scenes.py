"""The demo's embedded config and its sample runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The demo's MCP server, a child of the proxy over stdio (SPEC §13).
ALMANAC = [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]

DEMO_CONFIG: dict[str, Any] = {
    "upstreams": {"scripted": {"base_url": "http://127.0.0.1:0/v1", "max_retries": 0}},
    "default_upstream": "scripted",
    "pricing": {"scripted": {"input": 2.0, "output": 8.0}},
    "state": {"backend": "memory"},
    "tools": {
        "get_weather": {"kind": "python", "callable": "proxy.demo.tools:get_weather"},
        "to_fahrenheit": {"kind": "python", "callable": "proxy.demo.tools:to_fahrenheit"},
        "search_notes": {"kind": "python", "callable": "proxy.demo.tools:search_notes"},
        "final_answer": {"kind": "builtin"},
        "almanac": {"kind": "mcp", "command": ALMANAC, "timeout_s": 10},
    },
    "agents": {
        "weather": {
            "model": "scripted",
            "system_prompt": "You answer questions about the weather.",
            "tools": ["get_weather", "to_fahrenheit"],
        },
        "reporter": {
            "model": "scripted",
            "tools": ["get_weather", "final_answer"],
        },
        "researcher": {
            "model": "scripted",
            "tools": ["search_notes"],
            "stop_when": [{"max_cost": 0.004}],
        },
        "almanac": {
            "model": "scripted",
            "tools": ["almanac"],  # every tool of the MCP server
            "tool_call_limits": [{"tool_name": "sunrise", "run_limit": 1}],
        },
        "planner": {
            "model": "scripted",
            "tools": ["get_weather", "to_fahrenheit"],
            "tool_rules": [
                {"type": "run_first", "tool_name": "get_weather"},
                {
                    "type": "constrain_child_tools",
                    "tool_name": "get_weather",
                    "children": ["to_fahrenheit"],
                },
            ],
        },
    },
}


@dataclass(frozen=True)
class Scene:
    title: str
    model: str
    prompt: str
    loop: dict[str, Any] = field(default_factory=dict)


SCENES = [
    Scene(
        "A tool loop",
        "weather",
        "What is the weather in Paris? Use get_weather, then to_fahrenheit.",
    ),
    Scene(
        "A tool of an MCP server (stdio)",
        "almanac",
        "When is the sunrise in Oslo? Use sunrise.",
    ),
    Scene(
        "A terminal tool", "reporter", "Check get_weather in Oslo and give it with final_answer."
    ),
    Scene(
        "A budget stop (max_cost: the next step's estimated cost would pass it)",
        "researcher",
        "Settle the question: keep calling search_notes until sure.",
    ),
    Scene(
        "A step-limit stop",
        "scripted",
        "Keep going: keep calling search_notes.",
        {"tools": ["search_notes"], "max_steps": 3},
    ),
    Scene(
        "A rule violation: the model calls to_fahrenheit first (`!`), blocked; the run goes on",
        "planner",
        "!to_fahrenheit at once, then get_weather in Lima.",
    ),
    Scene(
        "A tool call limit (exit_behavior: end)",
        "scripted",
        "Check get_weather in Lima, and keep checking it.",
        {
            "tools": ["get_weather"],
            "tool_call_limits": [{"run_limit": 2, "exit_behavior": "end"}],
        },
    ),
    Scene(
        "A nudge, then a terminating tool",
        "scripted",
        "Just say hello.",
        {"tools": ["final_answer"], "terminating_config": {"tool_ids": ["final_answer"]}},
    ),
    Scene(
        "Nudges exhausted (422): no nudge allowed, the model answers without search_notes",
        "scripted",
        "Just say hello.",
        {
            "tools": ["final_answer", "search_notes"],
            "terminating_config": {"tool_ids": ["search_notes"], "consecutive_nudges": 0},
        },
    ),
]
