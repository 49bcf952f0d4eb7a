"""Bad input to `/v1/responses` is a 400 naming the field (SPEC §12.1, §4.4), never a 500."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import Proxy

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "x"}


def _image(fields: dict[str, Any]) -> dict[str, Any]:
    """A user message of one `input_image` part with `fields`."""
    return {"role": "user", "content": [{"type": "input_image", **fields}]}


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": "hi"}, "model"),
    ({"model": "scripted"}, "input"),
    ({"model": "scripted", "input": 5}, "input"),
    ({"model": "scripted", "input": ["hi"]}, "input[0]"),
    ({"model": "scripted", "input": [{"type": "nope"}]}, "input[0].type"),
    ({"model": "scripted", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": "scripted", "input": [{"role": "user", "content": 3}]}, "input[0].content"),
    (
        {"model": "scripted", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "input[0].content[0].text",
    ),
    ({"model": "scripted", "input": [{"type": "function_call", "call_id": "c"}]}, "input[0].name"),
    (
        {
            "model": "scripted",
            "input": [{"role": "user", "content": "x"}, CALL, {**OUTPUT, "call_id": "zz"}],
        },
        "input[2].call_id",
    ),
    ({"model": "scripted", "input": [OUTPUT]}, "input[0].call_id"),
    ({"model": "scripted", "input": [{"type": "item_reference"}]}, "input[0].id"),
    ({"model": "scripted", "input": "x", "tools": [{"name": "f"}]}, "tools[0].type"),
    ({"model": "scripted", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "scripted", "input": "x", "tools": {"type": "function"}}, "tools"),
    (
        {
            "model": "scripted",
            "input": "x",
            "tools": [{"type": "function", "name": "f", "parameters": 1}],
        },
        "tools[0].parameters",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "f"}],
        },
        "tools[1].name",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "x"}]}],
        },
        "tools[0].tools[0].type",
    ),
    (  # a client tool named as a server tool, after a hosted tool the proxy leaves out
        {
            "model": "weather",
            "input": "x",
            "tools": [{"type": "web_search"}, {"type": "custom", "name": "get_weather"}],
        },
        "tools[1].name",
    ),
    ({"model": "scripted", "input": "x", "tool_choice": "always"}, "tool_choice"),
    ({"model": "scripted", "input": "x", "instructions": 1}, "instructions"),
    ({"model": "scripted", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "scripted", "input": "x", "store": 1}, "store"),
    ({"model": "scripted", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "scripted", "input": "x", "max_tool_calls": "3"}, "max_tool_calls"),
    ({"model": "scripted", "input": "x", "temperature": "hot"}, "temperature"),
    ({"model": "scripted", "input": "x", "metadata": {"a": 1}}, "metadata.a"),
    (
        {"model": "scripted", "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
        "metadata",
    ),
    ({"model": "scripted", "input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"model": "scripted", "input": "x", "metadata": {"k": "v" * 513}}, "metadata.k"),
    (
        {
            "model": "scripted",
            "input": "x",
            "tools": [{"type": "function", "name": f"f{i}"} for i in range(513)],
        },
        "tools",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tools": [
                {
                    "type": "namespace",
                    "name": "n",
                    "tools": [{"type": "function", "name": f"f{i}"} for i in range(513)],
                }
            ],
        },
        "tools",
    ),
    ({"model": "scripted", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"model": "scripted", "input": "x", "text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"model": "scripted", "input": "x", "max_tool_calls": 2**63}, "max_tool_calls"),  # was a 500
    (
        {"model": "scripted", "input": "x", "include": ["message.output_text.logprobs", 7]},
        "include[1]",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "g"},
        },
        "tool_choice.name",
    ),
    (
        {"model": "scripted", "input": "x", "text": {"format": {"type": ["text"]}}},
        "text.format.type",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}},
        },
        "text.format.strict",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tool_choice": {"type": "allowed_tools", "mode": ["required"], "tools": []},
        },
        "tool_choice.mode",
    ),
    (
        {"model": "scripted", "input": "x", "tool_choice": {"type": "allowed_tools", "tools": 1}},
        "tool_choice.tools",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tool_choice": {"type": "allowed_tools", "mode": "none", "tools": []},
        },
        "tool_choice.mode",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tool_choice": {"type": "allowed_tools", "tools": [{"type": "function"}]},
        },
        "tool_choice.tools[0].name",
    ),
    (
        {
            "model": "scripted",
            "input": "x",
            "tools": [{"type": "function", "name": "f", "strict": "yes"}],
        },
        "tools[0].strict",
    ),
    ({"model": "scripted", "input": "x", "reasoning": {"effort": 2}}, "reasoning.effort"),
    ({"model": "scripted", "input": "x", "previous_response_id": 7}, "previous_response_id"),
    (
        {"model": "scripted", "input": "x", "previous_response_id": "resp_nope"},
        "previous_response_id",
    ),
    ({"model": "scripted", "input": "x", "background": True}, "background"),
    ({"model": "scripted", "input": "x", "conversation": "conv_1"}, "conversation"),
    (  # its template would be dropped: the model ran without it
        {"model": "scripted", "input": "x", "prompt": {"id": "pmpt_1", "variables": {}}},
        "prompt",
    ),
    ({"model": "scripted", "input": "x", "loop": {"max_steps": 0}}, "loop.max_steps"),
    (  # it went upstream as an image URL of "file-1"
        {"model": "scripted", "input": [_image({"file_id": "file-1"})]},
        "input[0].content[0].file_id",
    ),
    ({"model": "scripted", "input": [_image({})]}, "input[0].content[0].image_url"),
    ({"model": "scripted", "input": [_image({"image_url": 7})]}, "input[0].content[0].image_url"),
    (  # nothing a model reads: it went upstream as `messages: []` (the upstream's error relayed)
        {"model": "scripted", "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
        "input",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
async def test_bad_input_is_a_400_naming_the_field(
    proxy: Proxy, body: dict[str, Any], param: str
) -> None:
    r = await proxy.client.post("/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"]
    if param in ("background", "conversation", "prompt"):
        assert "not supported" in error["message"]
    if param == "previous_response_id" and isinstance(body["previous_response_id"], str):
        assert r.status_code == 404
    else:
        assert r.status_code == 400
        assert error["type"] == "invalid_request_error"
    assert proxy.upstream.bodies == []


async def test_fields_real_clients_send_are_accepted(proxy: Proxy) -> None:
    from tests.scripted_upstream import say

    proxy.upstream.script(say("ok"))
    r = await proxy.client.post(
        "/v1/responses",
        json={
            "model": "scripted",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                }
            ],
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "abc",
            "client_metadata": {"x": "y"},
            "truncation": "auto",
            "safety_identifier": "s",
            "service_tier": "auto",
            "reasoning": {"effort": "medium", "summary": "auto"},
            "stream_options": {"include_obfuscation": False},
            "background": False,
            "store": False,
            "tools": [{"type": "web_search"}, {"type": "local_shell"}],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["loop"]["ignored_tools"] == ["web_search", "local_shell"]


async def test_a_namespace_in_tool_choice_must_be_a_string(proxy: Proxy) -> None:
    choice = {"type": "function", "name": "f", "namespace": 3}
    r = await proxy.client.post(
        "/v1/responses", json={"model": "scripted", "input": "x", "tool_choice": choice}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice.namespace"
