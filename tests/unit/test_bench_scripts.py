"""The benchmark scripts still run and print a figure on every row (their numbers are not
checked here: speed belongs in the printed figures, not in timed tests)."""

from __future__ import annotations

import re

import pytest

from tests.bench import (
    body_stall,
    chain_storage,
    mcp_cost,
    mcp_stall,
    policy_cost,
    read_burst,
    resent_turns,
    telemetry_cost,
)


def test_the_telemetry_cost_benchmark_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    telemetry_cost.main(["--runs", "20"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["telemetry", "work", "CPU", "us"]
    rows = dict(line.rsplit(maxsplit=1) for line in lines[1:])
    assert len(rows) == 11
    assert float(rows["pass-through run: metrics observer"]) > 0
    assert float(rows["3-step tool run: spans observer"]) > 0
    assert float(rows["HTTP request: metrics and server span"]) > 0
    assert float(rows["HTTP request: metrics and server span (not sampled)"]) > 0


def test_the_mcp_cost_benchmark_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    mcp_cost.main(["--runs", "3"])
    lines = capsys.readouterr().out.splitlines()
    rows = dict(line.rsplit(maxsplit=1) for line in lines[1:])
    assert set(rows) == {"python tool", "MCP tool (stdio)", "added per MCP call"}
    assert float(rows["MCP tool (stdio)"]) > 0


def test_the_mcp_stall_benchmark_reads_each_size_through_both_clients(
    capsys: pytest.CaptureFixture[str],
) -> None:
    mcp_stall.main(["--mib", "0.5,1"])
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(client.strip(), size.strip()) for client, size, *_ in rows] == [
        ("loopwarden", "0.5"),
        ("loopwarden", "1"),
        ("mcp SDK", "0.5"),
        ("mcp SDK", "1"),
    ]
    assert all(float(took.replace(",", "")) > 0 for _, _, took, *_ in rows)


def test_the_policy_cost_benchmark_prints_every_feature(capsys: pytest.CaptureFixture[str]) -> None:
    policy_cost.main(["--runs", "3", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = {name: (cpu, added) for name, cpu, added in (ln.rsplit(maxsplit=2) for ln in lines[1:])}
    assert set(rows) == set(policy_cost.FEATURES)
    # Figures only: with 3 runs, what a feature adds may come out below zero in the noise.
    assert all(float(cpu) > 0 and int(added) == float(added) for cpu, added in rows.values())


def test_the_body_stall_benchmark_refuses_the_hostile_bodies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    body_stall.main(["--mib", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:30].strip(): line[30:].split() for line in lines[1:]}
    assert set(rows) == {*body_stall.SHAPES, body_stall.RESENT}
    statuses = {shape: figures[0] for shape, figures in rows.items()}
    assert statuses == {
        "empty arrays": "413",
        "numbers": "413",
        "small messages": "413",
        "long messages of prose": "200",
        "one base64 image": "200",
        "resent conversation": "200",
    }
    assert all(float(figure) > 0 for figures in rows.values() for figure in figures[1:])


def test_the_chain_storage_benchmark_stores_each_chain_in_parts_and_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Chained and resent alike in parts; whole larger, once the conversation is."""
    chain_storage.main(["--chains", "60x2000,20x100"])
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(row[0].strip(), row[1].strip()) for row in rows] == [
        (backend, chain) for backend in ("memory", "sqlite") for chain in ("60 x 2,000", "20 x 100")
    ]
    for _, chain, _, stored, *_ in rows:
        chained, resent, whole = (float(mode.split()[0]) for mode in stored.split(" / "))
        assert chained == resent
        assert chained < whole if chain.strip().startswith("60") else chained == whole


def test_the_resent_turns_benchmark_reads_as_few_records_each_way(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A turn of a conversation sent again reads the response it continues, whatever the
    number of earlier responses its references name, as a continuation by id does."""
    resent_turns.main(["--turns", "120", "--bytes", "100"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["backend", "way", "turn", "ms", "a", "turn", "reads", "KB", "read"]
    rows = [line.split() for line in lines[1:]]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (backend, way, mark)
        for backend in ("memory", "sqlite")
        for way in resent_turns.WAYS
        for mark in ("10", "100", "120")
    ]
    for backend, way, _, ms, reads, kb in rows:
        assert float(ms) > 0
        assert float(kb) > 0
        assert int(reads) <= (2 if way == "previous_response_id" else 3), (backend, way)


def test_the_read_burst_benchmark_answers_every_continuation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    read_burst.main(["--mib", "0.5", "--requests", "4", "--upstream-ms", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[1:])
    assert rows["statuses"] == "{'completed': 4}"
    assert float(rows["peak MB"]) > 0
    assert float(rows["longest stall ms"]) > 0
