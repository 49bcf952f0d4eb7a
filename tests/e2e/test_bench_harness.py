"""The benchmark's harness stays honest: its mock upstream answers like an OpenAI server, the
floor relays it unchanged (both through the real `openai` SDK), and `python -m
tests.bench.compare` runs end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.bench.load import WEATHER_TOOL, ttft
from tests.bench.processes import ROOT, running

pytestmark = pytest.mark.e2e

TEXT = " ".join(["mock"] * 16)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def relays(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with running(tmp_path_factory.mktemp("bench")) as servers:
        mock, _ = servers.mock("")
        floor, _ = servers.floor(mock, cpus="")
        floor_http1, _ = servers.floor(mock, cpus="", client="http1")
        yield {"direct": mock, "floor": floor, "floor http1": floor_http1}


@pytest.fixture(params=["direct", "floor", "floor http1"])
def client(request: pytest.FixtureRequest, relays: dict[str, str]) -> Iterator[OpenAI]:
    with OpenAI(base_url=relays[request.param], api_key="sk-bench", max_retries=0) as c:
        yield c


def test_a_json_chat_comes_back_whole(client: OpenAI) -> None:
    reply = client.chat.completions.create(model="mock", messages=ASK)
    assert reply.choices[0].message.content == TEXT
    assert reply.choices[0].finish_reason == "stop"
    assert reply.model == "mock"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 16


def test_a_streamed_chat_ends_with_the_usage_chunk(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="mock", messages=ASK, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16


def test_a_request_with_tools_gets_a_call_then_an_answer(client: OpenAI) -> None:
    first = client.chat.completions.create(model="mock", messages=ASK, tools=[WEATHER_TOOL])
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"celsius": 18}'},
    ]
    second = client.chat.completions.create(model="mock", messages=history, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "the tool said enough"
    assert second.choices[0].finish_reason == "stop"


def test_the_probe_sees_the_chunk_gap_of_the_model_suffix(relays: dict[str, str]) -> None:
    probe = ttft(relays["floor"], "mock+cd20", requests=2, warmup=0)
    assert (probe["requests"], probe["bad"]) == (2, 0)
    assert probe["ttft_p50_ms"] >= 20  # the role chunk, then 20 ms, then the first word
    assert probe["first_byte_p50_ms"] < probe["ttft_p50_ms"]


STEPS = ("loopwarden tool step", "loopwarden async tool step")


def test_compare_runs_end_to_end(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed (apt-get install -y wrk): the benchmark needs it")
    out = tmp_path / "runs.json"
    args = ["--duration", "1", "--reps", "1", "--conc", "1", "--modes", "json,stream"]
    args += ["--warmup", "0", "--ttft", "3", "--pause", "0", "--litellm", "off", "--out", str(out)]
    args += ["--tool-step"]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.compare", *args],
        capture_output=True, text=True, timeout=90, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for mode in ("json", "stream"):
        for target in ("direct", "floor", "floor http1", "loopwarden", *STEPS):
            assert f"| {mode} | 1 | {target} |" in done.stdout
        for kind in ("sync", "async"):
            assert f"- {mode} c=1: a server tool step ({kind} tool, " in done.stdout
        assert f"- {mode} c=1: loopwarden at " in done.stdout
    assert "| loopwarden | " in done.stdout  # the TTFT table
    runs = json.loads(out.read_text())
    assert len(runs["runs"]) == 12
    assert all(r["requests"] > 0 and r["error_count"] == 0 for r in runs["runs"])
    assert all(r["cpu_ms_per_req"] > 0 for r in runs["runs"])
    assert [(p["target"], p["requests"], p["bad"]) for p in runs["ttft"]] == [
        ("direct", 3, 0),
        ("floor", 3, 0),
        ("floor http1", 3, 0),
        ("loopwarden", 3, 0),
    ]


def test_the_busy_tool_benchmark_runs_a_computing_tool_beside_the_load() -> None:
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed (apt-get install -y wrk): the benchmark needs it")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.busy_tool", "--seconds", "1"],
        capture_output=True, text=True, timeout=90, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row[0].strip() for row in rows[1:]] == ["alone", "while a tool computes"]
    assert all(float(row[1].replace(",", "")) > 0 for row in rows[1:])
    assert "runs of the computing tool meanwhile: " in done.stdout
    assert "stopped by ['completed']" in done.stdout


def test_the_state_writes_benchmark_measures_every_backend() -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.state_writes", "--writes", "256", "--redis"],
        capture_output=True, text=True, timeout=90, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    named = [tuple(cell.strip() for cell in row[:3]) for row in rows[1:]]
    writes = (
        "run report",
        "stored response",
        "stored response, in parts",
        "stored response, one by one",
    )
    assert named == [
        (b, what, w) for b in ("memory", "sqlite", "redis") for what in writes for w in ("1", "64")
    ]
    assert all(float(row[3].replace(",", "")) > 0 for row in rows[1:])


def test_the_scaling_benchmark_compares_two_workers_with_two_processes() -> None:
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed (apt-get install -y wrk): the benchmark needs it")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.scaling", "--seconds", "1", "--reps", "1",
         "--conc", "8"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    named = [(row[0].strip(), row[1].strip()) for row in rows[1:]]
    targets = ("one worker", "serve --workers 2", "two processes")
    assert named == [(mode, target) for mode in ("json", "stream") for target in targets]
    assert all(float(row[2].replace(",", "")) > 0 for row in rows[1:])
    assert all(float(row[4]) > 0 for row in rows[1:])
    assert [row[3].strip() for row in rows[1:]][::3] == ["1.00x", "1.00x"]
    assert "- json: serve --workers 2 carries " in done.stdout


def test_the_calls_benchmark_counts_the_same_code_alike() -> None:
    """Against itself, the calls per request of each kind agree within 3 %: the figure that
    compares two versions where CPU times are too noisy to."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.calls", "--requests", "40", "--against", str(ROOT)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row[0].strip() for row in rows[1:]] == ["JSON", "SSE", "tool step"]
    counts = [[float(cell.replace(",", "")) for cell in row[1:]] for row in rows[1:]]
    assert all(this > 200 and abs(this - other) <= 0.03 * this for this, other in counts)
    json_calls, sse_calls, tool_step_calls = (this for this, _ in counts)
    assert sse_calls > json_calls
    assert tool_step_calls > json_calls
