"""Unit tests of the loader: durations, host:port splitting, YAML 1.1 traps, merge keys,
duplicate keys, unknown-field hints, and the refusal of hazardous files."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from confgen._decode import MAX_ERRORS
from confgen._fields import Duration, parse_duration
from confgen._yaml import MAX_BYTES
from confgen.envoy._proto import dur
from confgen.errors import TopologyError
from confgen.model import split_address
from confgen.nginx._context import duration
from confgen.topology import load, parse

BASE = """\
version: 1
name: t
listeners:
  - name: public
    port: 8080
pools:
  - name: local
    engine: vllm
    models: [m]
    workers: [127.0.0.1:8000]
"""


def _errors(text: str) -> list[str]:
    with pytest.raises(TopologyError) as info:
        parse(text.encode(), "t.yaml")
    return [str(d) for d in info.value.diagnostics]


@pytest.mark.parametrize(
    ("text", "ms"),
    [("250ms", 250), ("5s", 5000), ("1.5s", 1500), ("2m", 120_000), ("1h", 3_600_000), ("0s", 0),
     ("720h", 30 * 86_400_000)],
)
def test_parse_duration_accepts_unit_values(text: str, ms: int) -> None:
    """Durations need a unit of ms, s, m or h and are kept in whole milliseconds."""
    assert parse_duration(text) == Duration(ms)


@pytest.mark.parametrize("text", ["5", "5 s", "1d", "-1s", "0.5ms", "721h", "s", "1.s", "1e3ms", "5S", ""])
def test_parse_duration_refuses_the_rest(text: str) -> None:
    """No unit, spaces, unknown units, negatives, sub-millisecond values and more than 30
    days are refused."""
    assert parse_duration(text) is None


def test_duration_renders_for_envoy_and_nginx() -> None:
    """Envoy gets protobuf JSON seconds (fraction only when needed), nginx ms or s."""
    assert dur(Duration(1500)) == "1.500s"
    assert dur(Duration(5000)) == "5s"
    assert dur(Duration(0)) == "0s"
    assert duration(Duration(1500)) == "1500ms"
    assert duration(Duration(60_000)) == "60s"
    assert str(Duration(1500)) == "1500ms" and str(Duration(60_000)) == "60s"


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("[::1]:8000", ("::1", 8000)),
        ("[2001:db8::1]:65535", ("2001:db8::1", 65535)),
        ("vllm-0.svc.local:1", ("vllm-0.svc.local", 1)),
        ("::1:8000", None),
        ("[::1]8000", None),
        ("[::1]", None),
        ("127.0.0.1", None),
        ("127.0.0.1:0", None),
        ("127.0.0.1:65536", None),
        ("127.0.0.1:80a", None),
        ("127.0.0.1:+80", None),
        ("host:", None),
    ],
)
def test_split_address(text: str, parts: tuple[str, int] | None) -> None:
    """host:port splits on the last colon; IPv6 must be bracketed; ports are 1-65535 digits."""
    assert split_address(text) == parts


@pytest.mark.parametrize(
    ("line", "replace", "message"),
    [
        ("    workers: [127.0.0.1:8000]", "    workers: [127.0.0.1:8000]\n    health: {enabled: no}",
         "t.yaml:11:23: pools[0].health.enabled: expected true or false, got 'no' "
         "(YAML 1.1 spellings like yes/no/on/off are refused)"),
        ("name: t", "name: t\nmodels_endpoint: on",
         "t.yaml:3:18: models_endpoint: expected true or false, got 'on' "
         "(YAML 1.1 spellings like yes/no/on/off are refused)"),
        ("  - name: local", "  - name: no",
         "t.yaml:7:11: pools[0].name: expected a string, got a boolean 'no' "
         "(YAML 1.1 reads an unquoted 'no' as a boolean; quote it)"),
        ("    workers: [127.0.0.1:8000]", "    workers: [127.0.0.1:8000]\n    capacity: 0755",
         "t.yaml:11:15: pools[0].capacity: expected a decimal integer, got '0755'"),
        ("    workers: [127.0.0.1:8000]", "    workers: [127.0.0.1:8000]\n    capacity: 1_000",
         "t.yaml:11:15: pools[0].capacity: expected a decimal integer, got '1_000'"),
        ("    port: 8080", '    port: "8000"',
         "t.yaml:5:11: listeners[0].port: expected an integer, got the string '8000'; remove the quotes"),
        ("    port: 8080", "    port: 8080\n    stream_idle_timeout: 5",
         "t.yaml:6:26: listeners[0].stream_idle_timeout: expected a duration with a unit, such as 250ms, "
         "5s, 2m or 1h (at most 30 days), got '5'"),
        ("    port: 8080", "    port: 8080\n    stream_idle_timeout: '5'",
         "t.yaml:6:26: listeners[0].stream_idle_timeout: expected a duration with a unit, such as 250ms, "
         "5s, 2m or 1h (at most 30 days), got '5'"),
        ("    models: [m]", "    models: [1.5]",
         "t.yaml:9:14: pools[0].models[0]: expected a string, got a number '1.5' (quote it if it is meant as text)"),
        ("    port: 8080", "    port: 8080\n    max_request_bytes: 1e6",
         "t.yaml:6:24: listeners[0].max_request_bytes: expected a decimal integer, got '1e6'"),
        ("name: t", 'name: t\nmodels_endpoint: "false"',
         "t.yaml:3:18: models_endpoint: expected true or false, got the string 'false'; remove the quotes"),
        ("    port: 8080", "    port: 'eighty'",
         "t.yaml:5:11: listeners[0].port: expected an integer, got the string 'eighty'"),
    ],
)
def test_yaml11_traps_are_errors(line: str, replace: str, message: str) -> None:
    """YAML 1.1's loose typing is refused with a message saying what to write instead:
    yes/no/on/off booleans, octal 0755, 1_000, quoted numbers, unit-less durations, and
    numbers or booleans where text is expected."""
    assert line in BASE
    assert _errors(BASE.replace(line, replace, 1)) == [message]


def test_merge_keys_apply_and_own_keys_win() -> None:
    """`<<: *anchor` and `<<: [a, b]` merge mappings; the mapping's own keys override merged
    ones and an earlier source in a merge list wins over a later one."""
    text = BASE + """\
    health: &h {interval: 10s, timeout: 3s}
  - <<: [{engine: sglang, capacity: 7}, {engine: tgi, capacity: 9, models: [x]}]
    name: second
    models: [n]
    workers: [127.0.0.1:8001]
    health:
      <<: *h
      timeout: 1s
"""
    topo, _ = parse(text.encode(), "t.yaml")
    second = topo.pools[1]
    assert (second.engine, second.capacity, second.models) == ("sglang", 7, ["n"])
    assert (second.health.interval, second.health.timeout) == (parse_duration("10s"), parse_duration("1s"))


def test_duplicate_keys_name_both_lines() -> None:
    """A duplicate key is an error at the second occurrence that names the first's line
    (a plain YAML loader would keep the last one silently)."""
    text = BASE.replace("    port: 8080\n", "    port: 8080\n    port: 9090\n")
    assert _errors(text) == ["t.yaml:6:5: listeners[0].port: duplicate key 'port' (first defined at line 5)"]


def test_unknown_field_suggests_the_near_name() -> None:
    """An unknown field is an error with a "did you mean" for a near miss, and none for
    a name close to nothing."""
    text = BASE + "    balancing: {polcy: random}\n    qqqq: 1\n"
    assert _errors(text) == [
        "t.yaml:11:17: pools[0].balancing.polcy: unknown field; did you mean 'policy'?",
        "t.yaml:12:5: pools[0].qqqq: unknown field",
    ]


def test_errors_are_collected_not_stopped_at_the_first() -> None:
    """Independent errors across the document are all reported, sorted by place."""
    text = BASE.replace("name: t", "name: T").replace("port: 8080", "port: 0").replace("engine: vllm", "engine: vlm")
    assert len(_errors(text)) == 3


def test_alias_amplified_errors_stop_at_the_cap() -> None:
    """Aliases repeating one bad mapping thousands of times yield at most MAX_ERRORS
    diagnostics plus one saying the decoder stopped (not hundreds of thousands)."""
    bad = "{" + ", ".join(f"k{i}: 1" for i in range(50)) + "}"
    workers = "    workers: [" + ", ".join(["*bad"] * 1000) + "]"
    text = f"zz: &bad {bad}\n" + BASE.replace("    workers: [127.0.0.1:8000]", workers)
    errors = _errors(text)
    assert len(errors) == MAX_ERRORS + 1
    assert errors[0] == f"t.yaml:1:1: <document>: stopped after {MAX_ERRORS} errors; fix these first"


def _run(args: list[str], timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "confgen", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_ten_megabyte_file_is_refused_before_parsing(tmp_path: Path) -> None:
    """A 10 MB file is refused by size, at file:1:1, by `load` (which checks the size before
    reading) and by `parse` (bytes already in memory), and by the CLI within a few seconds."""
    big = tmp_path / "big.yaml"
    line = "# " + "x" * 1022 + "\n"
    big.write_text(BASE + line * (10 * 1024))
    assert big.stat().st_size > 10 * 1024 * 1024 > MAX_BYTES
    expected = f"{big}:1:1: <document>: file is 10.0 MiB; a topology may be at most 4 MiB"
    with pytest.raises(TopologyError) as info:
        load(big)
    assert [str(d) for d in info.value.diagnostics] == [expected]
    with pytest.raises(TopologyError) as info:
        parse(big.read_bytes(), str(big))
    assert [str(d) for d in info.value.diagnostics] == [expected]
    result = _run(["validate", str(big)], timeout=5)
    assert (result.returncode, result.stderr.splitlines()) == (1, [expected])


BOMB = "version: 1\nname: lol\nlol0: &a [" + ", ".join(['"lol"'] * 9) + "]\n" + "".join(
    f"lol{i}: &{chr(ord('a') + i)} [" + ", ".join([f"*{chr(ord('a') + i - 1)}"] * 9) + "]\n" for i in range(1, 9)
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BOMB, "the document expands to more than 500,000 nodes through anchors and aliases (an alias bomb?)"),
        ("version: 1\nname: &x [a, *x]\n", "an alias refers to itself (recursive anchors are refused)"),
        ("version: 1\nlisteners: &l\n  - name: a\n    x: *l\n",
         "an alias refers to itself (recursive anchors are refused)"),
        ("version: 1\nname: " + "[" * 900 + "]" * 900 + "\n", "the document nests more than 64 levels deep"),
    ],
    ids=["billion-laughs", "recursive-alias", "recursive-alias-in-mapping", "deep-nesting"],
)
def test_alias_bombs_and_recursion_are_refused_quickly(tmp_path: Path, text: str, message: str) -> None:
    """A billion-laughs document (10^9 nodes once expanded), a self-referencing alias and a
    deeply nested one are each refused with one clear error, bounded by a 15 s timeout on
    the whole CLI process (it answers in ~0.5 s; expanding the bomb would take minutes and
    gigabytes, so the bound still tells them apart, with room for interpreter start-up on a
    loaded machine: 5 s was overrun once at load 7.5)."""
    file = tmp_path / "t.yaml"
    file.write_text(text)
    result = _run(["validate", str(file)], timeout=15)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"{file}:1:1: <document>: {message}"]


def test_an_sglang_pool_whose_health_timeout_is_under_its_poll_is_warned() -> None:
    """SGLang's /health answers after its one-second poll at the earliest: the proxy's active check with a
    1 s timeout fails every healthy worker. Warned at the field (not an error: the path may be served by
    something else); 1.5 s and a custom path say nothing, nor do other engines."""

    def warnings(engine: str, timeout: str, path: str = "") -> list[str]:
        health = f"{{timeout: {timeout}{', path: ' + path if path else ''}}}"
        text = BASE.replace("engine: vllm", f"engine: {engine}") + f"    health: {health}\n"
        _, found = parse(text.encode(), "t.yaml")
        return [f"{d.path}: {d.message}" for d in found]

    assert any(w.startswith("pools[0].health.timeout: sglang's /health answers after 1 s")
               for w in warnings("sglang", "1s")), warnings("sglang", "1s")
    assert not warnings("sglang", "1500ms")
    assert not warnings("sglang", "1s", "/v1/models")
    assert not warnings("vllm", "1s")


def test_a_label_value_yaml_reads_as_a_date_or_a_value_key_is_an_error_not_a_traceback() -> None:
    """Found by review: `labels: {since: 2024-01-01}` (YAML 1.1 resolves an unquoted date to a timestamp) ended
    validate with a KeyError traceback, exit 1 and nothing on stdout with --format json. Each is an error at its
    place, saying what YAML made of it."""
    text = BASE.replace("workers: [127.0.0.1:8000]", "workers:\n      - address: 127.0.0.1:8000\n"
                        "        labels: {since: 2024-01-01, gpu: =, ok: a100}")
    errors = _errors(text)
    assert errors == [
        "t.yaml:12:25: pools[0].workers[0].labels.since: YAML reads the unquoted '2024-01-01' as a date: quote it "
        "if it is meant as text",
        "t.yaml:12:42: pools[0].workers[0].labels.gpu: YAML reads the unquoted '=' as a value key: quote it if it "
        "is meant as text",
    ], errors


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\u0085"])
def test_a_line_break_only_yaml_sees_is_refused(char: str) -> None:
    """Found by review: YAML 1.1 breaks lines at U+2028, U+2029 and U+0085, grep and diff viewers do not: a key
    after one inside what reads as a comment was applied (`allow_clients` hidden in `# TGI box`), validate said
    ok. Refused where it stands, as NUL is."""
    text = BASE.replace("    workers: [127.0.0.1:8000]\n",
                        f"    workers: [127.0.0.1:8000]   # box{char}    allow_clients: [interns]\n")
    errors = _errors(text)
    assert len(errors) == 1 and errors[0].startswith("t.yaml:10:38:") and f"U+{ord(char):04X}" in errors[0], errors


def test_a_long_fallback_chain_is_checked_in_about_linear_time() -> None:
    """Found by review: a chain p0 -> p1 -> ... of 400 pools took 14.7 s to validate (800: 90 s), the chain's
    membership test comparing whole pools. Names now: 400 pools in well under a second here, bounded at 5 s."""
    lines = ["version: 1", "name: t", "envoy: {max_eds_files: 1000}", "listeners: [{name: public, port: 8080}]",
             "pools:"]
    for i in range(400):
        lines += [f"  - name: p{i}", "    engine: vllm", f"    models: [m{i}, shared]",
                  f"    workers: [10.0.{i // 250}.{i % 250 + 1}:8000]"]
        if i < 399:
            lines.append(f"    fallback: p{i + 1}")
    started = time.monotonic()
    topo, _ = parse(("\n".join(lines) + "\n").encode(), "t.yaml")
    assert len(topo.pools) == 400
    assert time.monotonic() - started < 5.0


def test_kubernetes_label_keys_follow_kubernetes_syntax() -> None:
    """Found by review: pod_labels and monitoring_labels keys took any `label` (a/b/c, Ab_/c, x.), which the
    API server refuses while validate and render said ok."""
    good = BASE + "kubernetes: {monitoring_labels: {release: kps, app.kubernetes.io/part-of: x}}\n"
    parse(good.encode(), "t.yaml")
    for key in ("a/b/c", "Ab_/c", "x.", "-x"):
        errors = _errors(BASE + f"kubernetes: {{monitoring_labels: {{{key}: v}}}}\n")
        assert any("a Kubernetes label key" in e for e in errors), (key, errors)


def test_cross_field_findings_stop_at_the_cap_like_the_decoders() -> None:
    """Found by review: 150,000 duplicate workers printed 149,999 lines (23 s). The checks' findings stop at
    MAX_ERRORS too, saying so."""
    workers = ", ".join(["127.0.0.1:8000"] * (MAX_ERRORS + 100))
    errors = _errors(BASE.replace("workers: [127.0.0.1:8000]", f"workers: [{workers}]"))
    assert len(errors) == MAX_ERRORS + 1, len(errors)
    assert errors[-1].endswith(f"stopped after {MAX_ERRORS} findings; fix these first")
