"""docs/settings.md stays true: each KEY=VALUE flag's table lists exactly the keys the flag
accepts, with the type and the default of a sidecar started without the flag."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from sidecar.config import SidecarConfig, from_argv
from sidecar.outputs.picker.scheduling import COST_KEYS, POLICY_KEYS, SCORERS, PickerPolicy

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
TOPO = ["--topology", "topo.yaml"]  # never read by from_argv
FLAGS = ("--health", "--weights", "--hysteresis", "--saturation", "--picker")


def _documented() -> dict[str, dict[str, tuple[str, str]]]:
    """flag -> key -> (default cell, type cell), from the table under each `## `--flag`` heading."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    flag = None
    for n, line in enumerate(DOC.read_text().splitlines(), 1):
        if heading := re.fullmatch(r"## `(--[a-z]+)`", line):
            flag = heading[1]
            tables[flag] = {}
        elif line.startswith("## "):
            flag = None
        elif flag is not None and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert len(cells) == 5, f"docs/settings.md:{n}: expected 5 cells (no | inside one): {line}"
            key = cells[0].strip("`")
            assert key not in tables[flag], f"docs/settings.md:{n}: {flag} {key} listed twice"
            tables[flag][key] = (cells[1], cells[2])
    return tables


def _settable(config: SidecarConfig) -> dict[str, dict[str, object]]:
    """flag -> every key it accepts -> its value in `config` (the picker: a default PickerPolicy)."""
    out = {flag: {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
           for flag, policy in (("--health", config.health), ("--weights", config.weights),
                                ("--hysteresis", config.hysteresis), ("--saturation", config.saturation))}
    picker = PickerPolicy()
    weights = dict(picker.weights)
    out["--picker"] = {"rule": picker.rule, **{name: weights[name] for name in SCORERS},
                       **{key: getattr(picker, key) for key in POLICY_KEYS},
                       **{key: getattr(picker.cost, key) for key in COST_KEYS}}
    return out


def _kind(flag: str, key: str, default: object) -> type:
    """The type a flag reads the key's value as."""
    if flag == "--picker":
        return str if key == "rule" else float if key in SCORERS else {**POLICY_KEYS, **COST_KEYS}[key]
    return type(default)  # sidecar.config._override converts to the default's type


def test_every_settable_key_is_documented_and_no_other() -> None:
    documented, settable = _documented(), _settable(from_argv(TOPO))
    assert sorted(documented) == sorted(FLAGS)
    wrong = [f"{flag} {key}: accepted, not documented" for flag in FLAGS
             for key in sorted(set(settable[flag]) - set(documented[flag]))]
    wrong += [f"{flag} {key}: documented, not accepted" for flag in FLAGS
              for key in sorted(set(documented[flag]) - set(settable[flag]))]
    assert not wrong, "\n".join(wrong)


def test_documented_defaults_and_types_are_the_code_s() -> None:
    documented, settable = _documented(), _settable(from_argv(TOPO))
    wrong = []
    for flag in FLAGS:
        for key, (default_cell, type_cell) in documented[flag].items():
            if key not in settable[flag]:
                continue  # the test above names it
            actual = settable[flag][key]
            kind = _kind(flag, key, actual)
            literal = re.search(r"`([^`]+)`", default_cell)
            if literal is None or kind(literal[1]) != actual:
                wrong.append(f"{flag} {key}: documented {default_cell!r}, the code's default is {actual!r}")
            if type_cell.split(",")[0] != kind.__name__:
                wrong.append(f"{flag} {key}: documented type {type_cell!r}, the flag reads a {kind.__name__}")
    assert not wrong, "\n".join(wrong)


def test_defaults_that_follow_interval_say_so() -> None:
    """The defaults --interval moves are exactly those whose default cell names it."""
    base, other = _settable(from_argv(TOPO)), _settable(from_argv([*TOPO, "--interval", "4"]))
    moved = {(flag, key) for flag in FLAGS for key in base[flag] if base[flag][key] != other[flag][key]}
    said = {(flag, key) for flag, rows in _documented().items() for key, (cell, _) in rows.items()
            if "--interval" in cell}
    assert moved == said
