"""`upstreams`, `models` and `pricing`: where models are served, under which names, at what
price."""

from __future__ import annotations

from pydantic import Field, field_validator

from proxy.config.environment import EnvName
from proxy.config.model import ConfigModel, http_url

# The JSON values one whole (not streamed) reply may hold, counted before it is parsed: its
# parse holds the event loop ~0.1-0.2 us a value (a reply with `top_logprobs` for 16,000 tokens
# holds ~2 million: 0.25-0.4 s); 500,000 is 2,000-3,000 tokens with 20 top logprobs.
MAX_RESPONSE_VALUES = 500_000


class UpstreamConfig(ConfigModel):
    base_url: str
    api_key_env: EnvName | None = None
    # The longest the upstream may stay silent: to start its answer, or between two reads of it.
    timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    connect_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    # The most one step's upstream call may take in all, however the bytes trickle in: every
    # attempt, the waits between them, the whole body or stream.
    step_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    max_retries: int = Field(2, ge=0, le=10)
    # The longest wait before a retry, whatever the upstream's Retry-After asks.
    max_retry_wait_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    # What the proxy reads of one reply: the whole body or stream, one event of a stream, and
    # the tool calls of one reply (a reply over any of them is a 502 upstream_error).
    max_response_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_event_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_tool_calls_per_reply: int = Field(128, ge=1)
    max_response_values: int = Field(MAX_RESPONSE_VALUES, ge=1000)
    reports_cost: bool = False
    forward_client_key: bool = False  # send the client's Authorization header upstream
    provider: str | None = None  # gen_ai.provider.name; guessed from base_url when unset

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return http_url(value).rstrip("/")


class ModelAlias(ConfigModel):
    upstream: str | None = None
    model: str


class Price(ConfigModel):
    input: float = Field(ge=0, allow_inf_nan=False)
    output: float = Field(ge=0, allow_inf_nan=False)
