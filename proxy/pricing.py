"""The cost of a step: config prices first, then the bundled `genai-prices` data (SPEC §6.1)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import genai_prices

from proxy.config import Price
from proxy.engine.ports import Prices
from proxy.engine.usage import Usage

PER_MILLION = 1_000_000


@lru_cache(maxsize=512)
def bundled_prices(model: str) -> Prices | None:
    """USD per token from the bundled price data, or None for an unknown model."""
    try:
        calc = genai_prices.calc_price(
            genai_prices.Usage(input_tokens=PER_MILLION, output_tokens=PER_MILLION), model
        )
    except LookupError:
        return None
    return Prices(float(calc.input_price) / PER_MILLION, float(calc.output_price) / PER_MILLION)


class PriceTable:
    """Implements the engine's `PriceBook`."""

    def __init__(self, overrides: Mapping[str, Price]) -> None:
        self.overrides = {
            name: Prices(p.input / PER_MILLION, p.output / PER_MILLION)
            for name, p in overrides.items()
        }

    def prices(self, model: str) -> Prices | None:
        return self.overrides.get(model) or bundled_prices(model)

    def cost(self, model: str, usage: Usage) -> float | None:
        if model not in self.overrides:
            try:
                calc = genai_prices.calc_price(
                    genai_prices.Usage(
                        input_tokens=usage.prompt_tokens,
                        cache_read_tokens=_cached(usage),
                        output_tokens=usage.completion_tokens,
                    ),
                    model,
                )
                return float(calc.total_price)
            except LookupError:
                return None
        p = self.overrides[model]
        return usage.prompt_tokens * p.input + usage.completion_tokens * p.output


def _cached(usage: Usage) -> int | None:
    details = usage.details.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and cached > 0:
            return cached
    return None
