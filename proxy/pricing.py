"""The cost of a step: config prices first, then the bundled `genai-prices` data (SPEC §6.1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import genai_prices

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
    """Per-token rates from the bundled price data (looked up once per model), or None."""
    try:
        full = genai_prices.calc_price(
            genai_prices.Usage(input_tokens=PER_MILLION, output_tokens=PER_MILLION), model
        )
        cached = genai_prices.calc_price(
            genai_prices.Usage(input_tokens=PER_MILLION, cache_read_tokens=PER_MILLION), model
        )
    except LookupError:
        return None
    return Rates(
        float(full.input_price) / PER_MILLION,
        float(cached.input_price) / PER_MILLION,
        float(full.output_price) / PER_MILLION,
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
