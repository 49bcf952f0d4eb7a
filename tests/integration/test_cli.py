"""`loopwarden check` and `loopwarden demo`."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config.document import read_document
from proxy.demo.runner import free_port
from tests.integration.conftest import CheckConfig


def test_check_reports_every_error_with_its_path(check_config: CheckConfig) -> None:
    status, _, err = check_config(
        "default_upstream: nowhere\n"
        "tools:\n  t: {kind: http}\n"
        "agents:\n"
        "  a: {model: m, tools: [ghost], stop_when: [{max_cost: -1}]}\n"
    )
    assert status == 1
    assert "default_upstream: no upstream named 'nowhere'" in err
    assert "agents.a.tools[0]: no tool named 'ghost'" in err
    assert "agents.a.stop_when[0].max_cost: must be greater than 0" in err
    assert "tools.t: an http tool needs url" in err


def test_check_reports_every_wiring_error_of_an_agent_at_once(check_config: CheckConfig) -> None:
    """SPEC §3: every error. A terminating tool the config lacks hid the rest (each came only
    once the one before was fixed), and a rule's first problem hid the others."""
    status, _, err = check_config(
        "tools:\n"
        "  t1: {kind: builtin, builtin: final_answer}\n"
        "  t2: {kind: builtin, builtin: complete_task}\n"
        "agents:\n"
        "  a:\n"
        "    model: unpriced-model\n"
        "    tools: [t1, t2]\n"
        "    terminating_config: {tool_ids: [qq]}\n"
        "    tool_rules: [{type: run_first, tool_name: zz},"
        " {type: constrain_child_tools, tool_name: t1, children: [nope]}]\n"
        "    tool_call_limits: [{tool_name: t1, run_limit: 1, exit_behavior: end}]\n"
        "    stop_when: [{max_cost: 1}]\n"
    )
    assert status == 1
    lines = err.strip().splitlines()
    for told in [
        "agents.a.terminating_config.tool_ids[0]: no server tool named 'qq'",
        "agents.a.tool_rules[0].tool_name: 'zz' is not a tool of this run",
        "agents.a.tool_rules[1].children[0]: 'nope' is not a tool of this run",
        "agents.a.tool_call_limits[0].exit_behavior: exit_behavior 'end' on 't1' cannot stop",
        "agents.a.model: a cost condition is set but model 'unpriced-model' has no known price",
    ]:
        assert any(line.startswith(told) for line in lines), (told, lines)


def test_check_reports_an_expression_that_does_not_compile_with_the_shape_errors(
    check_config: CheckConfig,
) -> None:
    """An `expr` is compiled by the wiring, which needs the whole config: beside a shape error
    elsewhere it was told only once that was mended."""
    status, _, err = check_config(
        "agents:\n"
        "  a: {model: m, stop_when: [{expr: 'steps.size() >'}, {step_count_is: 3}]}\n"
        "  b: {model: m, bogus: 1}\n"
        "  c: {model: m, stop_when: [{expr: 'nope'}, {max_steps: 2}]}\n"
    )
    assert status == 1
    lines = err.strip().splitlines()
    assert "agents.b.bogus: unknown field" in lines
    assert any(line.startswith("agents.a.stop_when[0].expr: invalid CEL") for line in lines)
    assert any(line.startswith("agents.c.stop_when[1].max_steps: unknown") for line in lines)
    assert not any(line.startswith("agents.c.stop_when[0]") for line in lines), lines
    assert len(lines) == 3, lines


def test_check_rejects_unknown_keys(check_config: CheckConfig) -> None:
    status, _, err = check_config("server: {port: 8080, colour: blue}\n")
    assert status == 1
    assert "server.colour: unknown field" in err


def test_check_accepts_a_good_config(check_config: CheckConfig) -> None:
    checked = check_config(
        "tools:\n  final_answer: {kind: builtin}\n"
        "agents:\n  a: {model: gpt-4o-mini, tools: [final_answer], "
        "terminating_config: {tool_ids: [final_answer]}}\n"
    )
    assert (checked.status, checked.out) == (0, "config OK\n")


def test_check_notes_an_upstream_key_that_is_not_set(
    check_config: CheckConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optional (a local model server needs none), so not refused; but told, since an upstream
    that needs one answers every request 401."""
    monkeypatch.delenv("LOOPWARDEN_TEST_KEY", raising=False)
    config = (
        "upstreams:\n"
        "  main: {base_url: 'http://127.0.0.1:9/v1', api_key_env: LOOPWARDEN_TEST_KEY}\n"
        "default_upstream: main\n"
    )
    checked = check_config(config)
    assert (checked.status, checked.out) == (0, "config OK\n")
    note = "upstreams.main.api_key_env: note: LOOPWARDEN_TEST_KEY is not set: no key is sent\n"
    assert checked.err == note
    monkeypatch.setenv("LOOPWARDEN_TEST_KEY", "sk-test")
    assert check_config(config).err == ""


def alias_bomb(levels: int) -> str:
    """A YAML document of a few hundred bytes whose aliases expand to 10**levels values."""
    lines = ["x0: &l0 [a, a, a, a, a, a, a, a, a, a]"]
    lines += [f"x{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def merge_bomb(keys: int, merges: int) -> str:
    """A mapping of `keys` keys merged `merges` times into another: each merge copies every
    pair (100,000 merges of 4,000 keys, 439 KB: 100 s of CPU)."""
    one = "x0: &a {" + ", ".join(f"k{i}: 1" for i in range(keys)) + "}\n"
    return one + "x1: {<<: [" + ", ".join(["*a"] * merges) + "]}\n"


def merge_chain(length: int) -> str:
    """Mappings each merging the one before: their pairs copied length²/2 times (3,000: 14 s)."""
    lines = ["a0: &a0 {k0: 1}"] + [
        f"a{i}: &a{i} {{<<: *a{i - 1}, k{i}: 1}}" for i in range(1, length)
    ]
    return "\n".join(lines) + "\n"


def aliased_depth(levels: int) -> str:
    """A short document nested `levels` deep through aliases, each level one line."""
    lines = ["defs:", "  - &a0 []"]
    lines += [f"  - &a{i} [*a{i - 1}]" for i in range(1, levels)]
    return "\n".join([*lines, f"top: *a{levels - 1}", ""])


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("server: {port: 8080, port: 9090}\n", "found the key 'port' twice\n  at line 1"),
        ("agents:\n  a: {model: m}\n  a: {model: n}\n", "found the key 'a' twice"),
        ("a: " + "[" * 500 + "]" * 500 + "\n", "nested more than 64 levels deep (line 1, column"),
        (alias_bomb(8), "its aliases expand to more than 1,000,000 values"),
        ("server: {port: true}\n", "server.port: must be an integer"),
        ("server: {workers: 2.0}\n", "server.workers: must be an integer"),
        ("upstreams: {u: {base_url: 'http://u/v1', max_retries: true}}\n", "max_retries: must be"),
        (aliased_depth(100), "nested more than 64 levels deep, with aliases"),
        (aliased_depth(100).replace("defs:", "defs: !!pairs").replace("- &a", "- k: &a"), "deep"),
        ("a: &a [1, *a]\n", "a value holds itself"),
        (merge_bomb(4000, 100_000), "its merge keys (<<) copy more than 500,000 pairs"),
        (merge_chain(3000), "its merge keys (<<) copy more than 500,000 pairs"),
        # (1,400: past the merge bound, not its own: 2.6 s of merging before the alias bound)
        (merge_chain(1400), "its merge keys (<<) copy more than 500,000 pairs"),
        (
            "server:\n  port: 1" + "0" * 5000 + "\n",
            "integer of too many digits\n  at line 2, column 9",
        ),
        ("default_upstream: 0x" + "f" * 20_000 + "\n", "integer of too many digits\n  at line 1"),
        (
            "a:\n  ? " + "k" * 2000 + "\n  : 1\n  ? " + "k" * 2000 + "\n  : 2\n",
            "k" * 256 + "…' twice",
        ),
    ],
)
def test_check_refuses_what_yaml_would_take_but_the_config_should_not(
    check_config: CheckConfig, text: str, says: str
) -> None:
    status, _, err = check_config(text)
    assert status == 1
    assert says in err
    assert "Traceback" not in err


def test_check_bounds_the_server_tools_of_a_config(check_config: CheckConfig) -> None:
    """Each tool's schema is checked as the server starts (50,000 tools took 50 s)."""
    entries = "".join(f"  t{i}: {{kind: builtin, builtin: final_answer}}\n" for i in range(4097))
    status, _, err = check_config("tools:\n" + entries)
    assert (status, err.strip()) == (1, "tools: must have at most 4096 entries")
    status, out, _ = check_config("tools:\n" + entries.split("  t4096")[0])
    assert (status, out.strip()) == (0, "config OK")


def test_check_names_a_config_file_it_cannot_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"server: {}\n\xff\xfe\n")
    huge = tmp_path / "huge.yaml"
    huge.write_text(
        "pricing:\n" + "".join(f"  m{i}: {{input: 1, output: 2}}\n" for i in range(160_000))
    )
    for path, says in [
        (binary, f"{binary}: not UTF-8 (byte 11)"),
        (huge, f"{huge}: larger than 4194304 bytes"),
        (tmp_path, f"{tmp_path}: not a regular file"),
        (Path("/dev/zero"), "/dev/zero: not a regular file"),
    ]:
        assert main(["check", "--config", str(path)]) == 1
        assert capsys.readouterr().err.strip() == says


def test_check_and_serve_name_every_variable_the_config_needs_and_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("LW_UNSET_A", "LW_UNSET_B", "LW_UNSET_REDIS", "LW_UNSET_H"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # the default upstream's (else noted)
    monkeypatch.setenv("LW_EMPTY", "")
    path = tmp_path / "loopwarden.yaml"
    path.write_text(
        "auth:\n  keys:\n"
        "    - {name: a, key_env: LW_UNSET_A}\n"
        "    - {name: b, key_env: LW_EMPTY}\n"
        "state: {backend: redis, url_env: LW_UNSET_REDIS}\n"
        "tools:\n  t: {kind: http, url: 'http://127.0.0.1:9/t', headers_env: {X-Key: LW_UNSET_H}}\n"
    )
    said = [
        "auth.keys[0].key_env: environment variable LW_UNSET_A is not set",
        "auth.keys[1].key_env: environment variable LW_EMPTY is not set",
        "state.url_env: environment variable LW_UNSET_REDIS is not set",
        "tools.t.headers_env.X-Key: environment variable LW_UNSET_H is not set",
    ]
    assert main(["check", "--config", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == said
    assert main(["serve", "--config", str(path), "--port", str(free_port())]) == 1
    assert capsys.readouterr().err.splitlines() == said


def test_a_redis_url_without_its_scheme_is_named_by_check_and_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LW_REDIS", "localhost:6379")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # the default upstream's (else noted)
    path = tmp_path / "loopwarden.yaml"
    path.write_text("state: {backend: redis, url_env: LW_REDIS}\n")
    said = [
        "state.url_env: environment variable LW_REDIS holds no redis URL (one begins "
        "redis://, rediss://, unix://)"
    ]
    assert main(["check", "--config", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == said
    assert main(["serve", "--config", str(path), "--port", str(free_port())]) == 1
    assert capsys.readouterr().err.splitlines() == said


def test_a_variable_sent_in_a_header_that_cannot_be_is_named_by_check_and_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line break a secret's file ends with is dropped (see the next test); one inside a
    value, a control character or a character outside ASCII cannot go in a header."""
    monkeypatch.setenv("LW_KEY", "team\nsecret")
    monkeypatch.setenv("LW_UP", "sk-é")
    monkeypatch.setenv("LW_H", "tok\x01en")
    path = tmp_path / "loopwarden.yaml"
    path.write_text(
        "upstreams: {up: {base_url: 'http://127.0.0.1:9/v1', api_key_env: LW_UP}}\n"
        "default_upstream: up\n"
        "auth: {keys: [{name: a, key_env: LW_KEY}]}\n"
        "tools:\n  t: {kind: http, url: 'http://127.0.0.1:9/t', headers_env: {X-Key: LW_H}}\n"
    )
    cannot = "holds what an HTTP header cannot carry"
    said = [
        f"auth.keys[0].key_env: environment variable LW_KEY {cannot}",
        f"tools.t.headers_env.X-Key: environment variable LW_H {cannot}",
        f"upstreams.up.api_key_env: environment variable LW_UP {cannot}",
    ]
    assert main(["check", "--config", str(path)]) == 1
    assert [
        line[: line.index(cannot) + len(cannot)] for line in capsys.readouterr().err.splitlines()
    ] == said
    assert main(["serve", "--config", str(path), "--port", str(free_port())]) == 1
    assert [
        line[: line.index(cannot) + len(cannot)] for line in capsys.readouterr().err.splitlines()
    ] == said


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        ("auth: {keys: [{name: a, key_env: ''}]}", "auth.keys[0].key_env"),
        ("auth: {keys: [{name: a, key_env: 'A=B'}]}", "auth.keys[0].key_env"),
        ("state: {url_env: 'REDIS URL'}", "state.url_env"),
        (
            "tools: {t: {kind: http, url: 'http://h/t', headers_env: {'X Key': K}}}",
            "tools.t.headers_env",
        ),
    ],
)
def test_names_of_variables_and_headers_that_cannot_be_are_config_errors(
    check_config: CheckConfig, entry: str, path: str
) -> None:
    status, _, err = check_config(entry + "\n")
    assert status == 1
    assert err.startswith(path)
    assert "must match" in err


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        ("tools: {t: {kind: http, url: 'http://h/t', timeout_s: .inf}}", "tools.t.timeout_s"),
        (
            "conditions: {w: {kind: webhook, url: 'http://h/w', timeout_s: .inf}}",
            "conditions.w.timeout_s",
        ),
        ("pricing: {m: {input: .inf, output: 1}}", "pricing.m.input"),
        ("pricing: {m: {input: 1, output: .nan}}", "pricing.m.output"),
        ("server: {keepalive_interval_s: .inf}", "server.keepalive_interval_s"),
    ],
)
def test_an_infinite_duration_or_price_is_a_config_error(
    check_config: CheckConfig, entry: str, path: str
) -> None:
    """An endless tool timeout failed every call; an infinite price made the cost metric NaN."""
    status, _, err = check_config(entry + "\n")
    assert status == 1
    assert err.startswith(path)
    assert "finite number" in err


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        ("tools: {'get weather': {kind: builtin, builtin: final_answer}}", "tools"),
        ("tools: {'x.y': {kind: builtin, builtin: final_answer}}", "tools"),
        (f"tools: {{{'n' * 65}: {{kind: builtin, builtin: final_answer}}}}", "tools"),
        ("upstreams: {u: {base_url: 'http://127.0.0.1:notaport/v1'}}", "upstreams.u.base_url"),
        ("upstreams: {u: {base_url: 'http://127.0.0.1:99999/v1'}}", "upstreams.u.base_url"),
        ("upstreams: {u: {base_url: 'http://[::1/v1'}}", "upstreams.u.base_url"),
        ("upstreams: {u: {base_url: 'http://a b/v1'}}", "upstreams.u.base_url"),
        ("tools: {t: {kind: http, url: 'docs-svc:9000/search'}}", "tools.t.url"),
        ("tools: {t: {kind: mcp, url: 'http://:80/mcp'}}", "tools.t.url"),
        ("conditions: {w: {kind: webhook, url: 'ftp://h/w'}}", "conditions.w.url"),
        (
            "tools: {t: {kind: http, url: 'http://h/t', headers_env: {Content-Length: V}}}",
            "tools.t.headers_env.Content-Length",
        ),
    ],
)
def test_a_url_no_request_can_go_to_or_a_header_the_client_sets_is_a_config_error(
    check_config: CheckConfig, entry: str, path: str
) -> None:
    status, _, err = check_config(entry + "\n")
    assert status == 1
    assert err.startswith(path)


def test_python_tools_are_imported_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `python -m proxy` imports them: `loopwarden` is a script, whose own directory (not
    the one it runs in) is on the path."""
    (tmp_path / "here_tools").mkdir()
    code = "def word_count(text: str) -> int:\n    return 1\n"
    (tmp_path / "here_tools" / "text.py").write_text(code)
    (tmp_path / "loopwarden.yaml").write_text(
        "tools: {words: {kind: python, callable: 'here_tools.text:word_count'}}\n"
    )
    (tmp_path / "yaml").mkdir()  # a folder named as an installed package stands for nothing
    (tmp_path / "yaml" / "__init__.py").write_text("raise SystemExit('the wrong yaml')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "yaml")
    assert main(["check", "--config", "loopwarden.yaml"]) == 0, capsys.readouterr().err
    assert sys.path[-1] == str(tmp_path)


def test_numbers_in_exponent_form_are_numbers(
    check_config: CheckConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As YAML 1.2 and JSON read them, and as Helm's `toYaml` writes small ones: `5e-3` was
    the string "5e-3" to YAML 1.1 ("must be a number")."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # the default upstream's (else noted)
    prices = "pricing: {m: {input: 1e-07, output: 2E+1}}\n"
    checked = check_config(
        prices + "agents: {a: {model: m, stop_when: [{max_cost: 5e-3}, {max_duration_s: 1.5e2}]}}\n"
    )
    assert (checked.status, checked.err) == (0, "")
    checked = check_config(prices + "agents: {a: {model: m, stop_when: [{max_cost: 5e-x}]}}\n")
    assert checked.status == 1
    assert "agents.a.stop_when[0].max_cost: must be a number" in checked.err


def test_a_mapping_merged_deeper_than_its_anchor_is_no_repeated_key(tmp_path: Path) -> None:
    """PyYAML flattens a merged mapping in place: one built through a merge before its own
    turn comes holds the inherited key and its own override side by side."""
    path = tmp_path / "merged.yaml"
    path.write_text(
        "defaults: &base {timeout_s: 30}\n"
        "agents:\n  nested:\n    extra: &mid\n      <<: *base\n      timeout_s: 60\n"
        "other:\n  <<: *mid\n"
    )
    document = read_document(path)
    assert document["other"] == {"timeout_s": 60}
    assert document["agents"]["nested"]["extra"] == {"timeout_s": 60}


def test_a_merge_key_may_bring_keys_the_mapping_also_names(check_config: CheckConfig) -> None:
    checked = check_config(
        "upstreams:\n"
        "  a: &base {base_url: 'http://a/v1', timeout_s: 5}\n"
        "  b: {<<: *base, base_url: 'http://b/v1'}\n"
        "default_upstream: a\n"
    )
    assert (checked.status, checked.out) == (0, "config OK\n")


def test_demo_shows_each_stop_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine's web proxy (here one that is not there) is not for the demo's own calls.
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    reasons = ("completed", "terminal_tool", "cost_budget", "max_steps", "nudges_exhausted")
    for reason in (*reasons, "tool_call_limit"):
        assert f"stop_reason : {reason}" in out
    assert "blocked     : " in out
    scenes = out.split("\n── ")[1:-1]  # each run's, and the metrics last
    assert len(scenes) == out.count("stop_reason : ") >= 9
    for scene in scenes:  # each with its span tree
        tree = scene.split("  spans       :\n", 1)[1]
        assert tree.startswith("    POST /v1/")
        assert "       invoke_agent " in tree
    first = scenes[0].split("  spans       :\n", 1)[1]
    assert first.count("          chat scripted") == 3
    assert "          execute_tool get_weather" in first
    assert (
        'loopwarden_runs_total{agent="researcher",model="scripted",stop_reason="cost_budget"} 1'
        in out
    )
    assert 'loopwarden_tool_calls_total{outcome="blocked_rule",tool="to_fahrenheit"} 1' in out
    assert "is not allowed now by the tool rules. Allowed tools: get_weather." in out
    assert "Here is what I found: 69.8°F" in out
    # What set each run up, the stop's details as JSON, and attributes by their real names.
    assert '  agent config: {"tools": ["search_notes"], "stop_when": [{"max_cost": 0.004}]}' in out
    assert '  loop        : {"tools": ["search_notes"], "max_steps": 3}' in out
    assert '"kind": "max_cost", "threshold": 0.004' in out
    assert "loopwarden.stop_reason=completed, loopwarden.steps=3" in first
    assert "• event loopwarden.nudge (step 1)" in out


def test_the_readme_config_example_is_valid() -> None:
    import yaml

    from proxy.config import parse_config

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    example = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_config(yaml.safe_load(example))
    agent = config.agents["researcher"]
    assert [r.type for r in agent.tool_rules] == ["run_first"]
    assert agent.tool_call_limits[0].thread_limit == 50


def test_the_probe_port_must_be_a_port_of_its_own(
    check_config: CheckConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checked = check_config("server: {port: 8080, probe_port: 8080}\n")
    assert checked.status == 1
    assert "server: probe_port must differ from port" in checked.err
    config = tmp_path / "loopwarden.yaml"
    config.write_text("server: {probe_port: 8081}\n")
    assert main(["serve", "--config", str(config), "--port", "8081"]) == 1
    assert "server: probe_port must differ from port" in capsys.readouterr().err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_names_what_would_stop_it_starting_before_it_serves(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    workers: str,
) -> None:
    """Said once, each in a line, exit 1: not a traceback of each worker (exit 3), nor workers
    started again for ever."""
    (tmp_path / "a-folder").mkdir()
    config = tmp_path / "loopwarden.yaml"
    config.write_text(
        f"state: {{backend: sqlite, path: '{tmp_path / 'a-folder'}'}}\n"
        "tools: {t: {kind: python, callable: 'no_such_module_here:f'}}\n"
    )
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "bogus")
    serve = ["serve", "--config", str(config), "--port", str(free_port()), "--workers", workers]
    assert main(serve) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tools.t: cannot import 'no_such_module_here': No module named 'no_such_module_here'",
        f"state.path: cannot open '{tmp_path / 'a-folder'}': unable to open database file",
        "OTEL_TRACES_EXPORTER: 'bogus' is not one of otlp, console, none",
    ]


def test_serve_says_which_port_it_cannot_listen_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "loopwarden.yaml"
    config.write_text("state: {backend: sqlite, path: state.db}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = ["serve", "--config", str(config), "--host", "127.0.0.1"]
        assert main([*serve, "--port", str(free_port()), "--probe-port", str(port)]) == 1
        assert f"server.probe_port: cannot listen on 127.0.0.1:{port}: " in capsys.readouterr().err
        for workers in ("2", "1"):
            assert main([*serve, "--port", str(port), "--workers", workers]) == 1
            assert f"server.port: cannot listen on 127.0.0.1:{port}: " in capsys.readouterr().err
    unknown = ["serve", "--config", str(config), "--host", "no-such-host.invalid"]
    assert main([*unknown, "--port", str(free_port())]) == 1
    assert "server.port: cannot listen on no-such-host.invalid:" in capsys.readouterr().err


def test_the_cli_says_its_version_and_what_each_command_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from proxy import __version__

    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out == f"loopwarden {__version__}\n"
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "(no keys, no network)" in " ".join(capsys.readouterr().out.split())  # (wrapped)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "(default: $LOOPWARDEN_CONFIG, else" in " ".join(capsys.readouterr().out.split())


def test_check_takes_merge_keys_within_their_bound(check_config: CheckConfig) -> None:
    text = (
        "upstreams:\n"
        "  a: &up {base_url: 'http://127.0.0.1:9/v1', timeout_s: 5}\n"
        "  b: {<<: [" + ", ".join(["*up"] * 1000) + "], timeout_s: 9}\n"
        "default_upstream: b\n"
    )
    assert check_config(text) == (0, "config OK\n", "")
