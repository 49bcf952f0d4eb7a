"""What the demo prints of its telemetry: one run's span tree and the metrics that changed."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, tuple[tuple[str, str], ...]]
_SHOWN_ATTRIBUTES = (
    "loopwarden.stop_reason",
    "loopwarden.steps",
    "loopwarden.tool_calls",
    "loopwarden.cost_usd",
    "loopwarden.step",
    "loopwarden.tool.outcome",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
    "http.response.status_code",
)


def span_tree(spans: Sequence[ReadableSpan], run_id: str) -> list[str]:
    """The trace of the run `run_id`, from its server span down, one line a span."""
    run = next(s for s in spans if (s.attributes or {}).get("loopwarden.run_id") == run_id)
    trace_id = run.context.trace_id
    members = sorted((s for s in spans if s.context.trace_id == trace_id), key=_start)
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in members:
        children.setdefault(span.parent.span_id if span.parent else None, []).append(span)
    lines: list[str] = []

    def walk(span: ReadableSpan, depth: int) -> None:
        attributes = span.attributes or {}
        shown = ", ".join(
            f"{key}={_value(attributes[key])}" for key in _SHOWN_ATTRIBUTES if key in attributes
        )
        ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
        lines.append(f"{'   ' * depth}{span.name}  [{ms:.1f} ms] {shown}")
        for child in children.get(span.context.span_id, []):
            walk(child, depth + 1)
        for event in span.events:  # (after the steps: most come as the run ends)
            step = (event.attributes or {}).get("loopwarden.step")
            at = f" (step {step})" if step is not None else ""
            lines.append(f"{'   ' * (depth + 1)}• event {event.name}{at}")

    for root in children.get(None, []):
        walk(root, 0)
    return lines


def samples(exposition: str) -> dict[Sample, float]:
    """The counters of a `/metrics` text."""
    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if not sample.name.endswith("_total"):  # counters tell the story; skip histograms
                continue
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def changed(before: dict[Sample, float], after: dict[Sample, float]) -> list[str]:
    lines = []
    for key, value in sorted(after.items()):
        if value != before.get(key, 0.0):
            name, labels = key
            shown = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{name}{{{shown}}} {_value(value)}")
    return lines


def _start(span: ReadableSpan) -> int:
    return span.start_time or 0


def _value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)
