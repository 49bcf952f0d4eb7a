"""The load of the side-by-side: wrk at a fixed concurrency for a fixed time (closed loop), and
a sequential streaming probe of the time to the first token."""

from __future__ import annotations

import http.client
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

LUA = Path(__file__).with_name("post.lua")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def chat_body(model: str, stream: bool, tools: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 64,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if tools:
        body["tools"] = [WEATHER_TOOL]
    return orjson.dumps(body)


def wrk(
    base_url: str,
    model: str,
    *,
    conc: int,
    seconds: float,
    stream: bool,
    key: str = "",
    tools: bool = False,
    cpus: str = "",
) -> dict[str, Any]:
    """RPS, p50/p99 latency (ms) and error counts of `conc` connections posting one chat
    request after the other for `seconds` to `base_url`/chat/completions."""
    binary = shutil.which("wrk")
    if binary is None:
        raise RuntimeError("wrk is not installed (apt-get install -y wrk)")
    url = base_url.rstrip("/") + "/chat/completions"
    command = [binary, "-t1", f"-c{conc}", f"-d{max(1, round(seconds))}s", "--timeout", "30s"]
    command += ["--latency", "-s", str(LUA), url]
    if cpus:
        command = ["taskset", "-c", cpus, *command]
    env = {**os.environ, "BENCH_BODY": chat_body(model, stream, tools).decode(), "BENCH_KEY": key}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=seconds + 60)
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"wrk failed on {url}: {done.stdout}{done.stderr}")
    result: dict[str, Any] = orjson.loads(line.removeprefix("WRKJSON "))
    result["error_count"] = sum(result["errors"].values())
    return result


def ttft(
    base_url: str, model: str, requests: int, key: str = "", warmup: int = 3
) -> dict[str, Any]:
    """Sequential streamed chat requests on one connection: the p50 (ms) of the time to the
    first SSE event with content (or a tool call), and of the time to the first body byte."""
    parts = urlsplit(base_url.rstrip("/") + "/chat/completions")
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    body = chat_body(model, stream=True)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)
    first_tokens: list[float] = []
    first_bytes: list[float] = []
    bad = 0
    try:
        for i in range(warmup + requests):
            start = time.perf_counter()
            conn.request("POST", parts.path, body=body, headers=headers)
            response = conn.getresponse()
            token_at, byte_at, complete = _read_stream(response)
            if response.status != 200 or token_at is None or byte_at is None or not complete:
                bad += 1
                conn.close()
            elif i >= warmup:
                first_tokens.append(1000 * (token_at - start))
                first_bytes.append(1000 * (byte_at - start))
    finally:
        conn.close()
    return {
        "requests": len(first_tokens),
        "bad": bad,
        "ttft_p50_ms": statistics.median(first_tokens) if first_tokens else None,
        "first_byte_p50_ms": statistics.median(first_bytes) if first_bytes else None,
    }


def _read_stream(response: http.client.HTTPResponse) -> tuple[float | None, float | None, bool]:
    """When the first byte and the first content came, and whether `[DONE]` ended it."""
    first = response.read(1)
    byte_at = time.perf_counter() if first else None
    token_at, complete, pending = None, False, first
    while line := pending + response.readline():
        pending = b""
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            complete = True
        elif token_at is None:
            choices = orjson.loads(data).get("choices") or [{}]
            delta = choices[0].get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                token_at = time.perf_counter()
    return token_at, byte_at, complete
