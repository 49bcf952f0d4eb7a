"""The cost of a step: config prices first, then the bundled `genai-prices` data (SPEC §6.1)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import astuple, dataclass
from functools import lru_cache

import genai_prices
import genai_prices.data  # the bundled prices (~30 ms to read): at start, not in a request

from proxy.config.upstreams import Price
from proxy.engine.usage import Usage
from proxy.engine.values import Prices

PER_MILLION = 1_000_000


@dataclass(frozen=True, slots=True)
class Rates:
    """USD per token, with the cached-input rate the bundled data may know."""

    input: float
    cached_input: float
    output: float


@lru_cache(maxsize=512)
def bundled_rates(model: str) -> Rates | None:
    """Per-token rates from the bundled price data at a million tokens (a tiered model's
    highest: what budgets size a step with), looked up once per model, or None."""
    return _rates_at(model, PER_MILLION)


@lru_cache(maxsize=512)
def catalogued(model: str) -> str | None:
    """The bundled data's id of the model a name is priced as (`gpt-4o` for
    `gpt-4o-2024-08-06`, `claude-3-5-sonnet` for any `claude-3-5-sonnet-*`), or None: one of a
    bounded set, whatever name a client sends."""
    try:
        found = genai_prices.calc_price(genai_prices.Usage(input_tokens=1), model)
    except LookupError:
        return None
    return str(found.model.id)


@lru_cache(maxsize=512)
def tiered(model: str) -> bool:
    """Whether the bundled data prices the model by tiers of prompt size (Gemini 2.5 Pro:
    more a token past 200,000): its steps are priced for their own usage, not at a rate."""
    small, large = _rates_at(model, 1_000), bundled_rates(model)
    if small is None or large is None:
        return False
    pairs = zip(astuple(small), astuple(large), strict=True)
    return not all(math.isclose(a, b, rel_tol=1e-9) for a, b in pairs)


def _rates_at(model: str, tokens: int) -> Rates | None:
    try:
        full = genai_prices.calc_price(
            genai_prices.Usage(input_tokens=tokens, output_tokens=tokens), model
        )
        cached = genai_prices.calc_price(
            genai_prices.Usage(input_tokens=tokens, cache_read_tokens=tokens), model
        )
    except LookupError:
        return None
    return Rates(
        float(full.input_price) / tokens,
        float(cached.input_price) / tokens,
        float(full.output_price) / tokens,
    )


class PriceTable:
    """Implements the engine's `PriceBook`."""

    def __init__(self, overrides: Mapping[str, Price]) -> None:
        self.overrides = {
            name: Rates(p.input / PER_MILLION, p.input / PER_MILLION, p.output / PER_MILLION)
            for name, p in overrides.items()
        }

    def _rates(self, model: str) -> Rates | None:
        return self.overrides.get(model) or bundled_rates(model)

    def prices(self, model: str) -> Prices | None:
        rates = self._rates(model)
        return Prices(rates.input, rates.output) if rates else None

    def cost(self, model: str, usage: Usage) -> float | None:
        rates = self._rates(model)
        if rates is None:
            return None
        cached = min(_cached(usage), usage.prompt_tokens)
        if model not in self.overrides and tiered(model):  # (a call of ~60 µs: tiered only)
            spent = genai_prices.Usage(
                input_tokens=usage.prompt_tokens,
                cache_read_tokens=cached,
                output_tokens=usage.completion_tokens,
            )
            return float(genai_prices.calc_price(spent, model).total_price)
        return (
            (usage.prompt_tokens - cached) * rates.input
            + cached * rates.cached_input
            + usage.completion_tokens * rates.output
        )


def _cached(usage: Usage) -> int:
    details = usage.details.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and cached > 0:
            return cached
    return 0
