"""A run's `loop` report (SPEC §4.2): what every route answers with, and keeps."""

from __future__ import annotations

from typing import Any

from proxy.engine.run_spec import RunResult


def loop_report(result: RunResult, include_messages: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "run_id": result.run_id,
        "stop_reason": result.stop.reason.value,
        "steps": result.steps,
        "tool_calls": result.tool_calls,
        "cost_usd": round(result.cost_usd, 10) if result.cost_usd is not None else None,
    }
    if result.stop.details:
        report["stop_details"] = result.stop.details
    if include_messages:
        report["messages"] = result.generated
    return report
