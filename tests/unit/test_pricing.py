"""SPEC §6.1: config prices first, then the bundled price data."""

from __future__ import annotations

import pytest

from proxy.config.upstreams import Price
from proxy.engine.usage import Usage
from proxy.pricing import PriceTable


def test_config_price_wins_and_is_per_million_tokens() -> None:
    table = PriceTable({"gpt-4o-mini": Price(input=1.0, output=2.0)})
    assert table.cost("gpt-4o-mini", Usage(1_000_000, 500_000, 1_500_000)) == pytest.approx(2.0)


def test_bundled_prices_know_common_models() -> None:
    table = PriceTable({})
    prices = table.prices("gpt-4o-mini")
    assert prices is not None
    assert prices.output > prices.input > 0
    cost = table.cost("gpt-4o-mini", Usage(1000, 1000, 2000))
    assert cost == pytest.approx(1000 * prices.input + 1000 * prices.output)


def test_unknown_models_have_no_price() -> None:
    table = PriceTable({})
    assert table.prices("surely-not-a-model-xyz") is None
    assert table.cost("surely-not-a-model-xyz", Usage(1, 1, 2)) is None


def test_cached_prompt_tokens_cost_the_cached_rate() -> None:
    import genai_prices

    usage = Usage(1000, 200, 1200, {"prompt_tokens_details": {"cached_tokens": 400}})
    expected = genai_prices.calc_price(
        genai_prices.Usage(input_tokens=1000, cache_read_tokens=400, output_tokens=200),
        "gpt-4o-mini",
    ).total_price
    assert PriceTable({}).cost("gpt-4o-mini", usage) == pytest.approx(float(expected))


@pytest.mark.parametrize("prompt", [10_000, 250_000])
def test_a_model_priced_by_tiers_is_charged_the_tier_of_its_step(prompt: int) -> None:
    """Gemini 2.5 Pro costs more a token past 200,000 prompt tokens: a step below that was
    charged the higher tier (1.8 times its price). Budgets still size a step at the highest."""
    import genai_prices

    usage = Usage(prompt, 1000, prompt + 1000, {"prompt_tokens_details": {"cached_tokens": 100}})
    expected = genai_prices.calc_price(
        genai_prices.Usage(input_tokens=prompt, cache_read_tokens=100, output_tokens=1000),
        "gemini-2.5-pro",
    ).total_price
    table = PriceTable({})
    assert table.cost("gemini-2.5-pro", usage) == pytest.approx(float(expected))
    highest = table.prices("gemini-2.5-pro")
    assert highest is not None
    assert highest.input * prompt >= float(expected) - 1000 * highest.output
