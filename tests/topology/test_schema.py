"""The JSON Schema published for editors: generated from the model, committed, valid
draft-07, and in agreement with the decoder on the examples and the case folders."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from confgen.schema import schema, schema_text

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "schema" / "topology.schema.json"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
VALID_CASES = sorted((ROOT / "tests" / "cases" / "valid").glob("*/topology.yaml"))


def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(COMMITTED.read_text()))


def test_committed_schema_equals_the_generated_one() -> None:
    """schema/topology.schema.json is exactly what the model generates (regenerate it with
    `confgen schema > schema/topology.schema.json` after changing the model)."""
    assert COMMITTED.read_text() == schema_text()


def test_schema_is_valid_draft7() -> None:
    """The schema declares draft-07 and passes the draft-07 meta-schema."""
    doc = schema()
    assert doc["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(doc)


@pytest.mark.parametrize("path", EXAMPLES + VALID_CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_valid_topologies_validate_against_the_schema(path: Path) -> None:
    """Every example and every edge-valid case passes the committed schema, so editors do
    not flag files the decoder accepts."""
    assert EXAMPLES and VALID_CASES
    errors = [e.message for e in _validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d["listeners"][0].update(adress="0.0.0.0"), "'adress' does not match any of the regexes"),
        (lambda d: d["listeners"][0].update(port="8080"), "is not of type 'integer'"),
        (lambda d: d["pools"][0].update(engine="vlm"), "is not one of"),
        (lambda d: d["pools"][0].update(name="Bad Name"), "does not match"),
        (lambda d: d["pools"][0]["workers"].append({"weight": 2}), "is not valid under any of the given schemas"),
        (lambda d: d["pools"][0].update(health={"interval": "5"}), "does not match"),
        (lambda d: d.pop("pools"), "'pools' is a required property"),
    ],
    ids=["unknown-field", "quoted-port", "engine", "name-pattern", "worker-no-address", "duration", "required"],
)
def test_schema_rejects_what_the_decoder_rejects(mutate: object, fragment: str) -> None:
    """The schema is not vacuous: unknown fields, wrong types, enums, patterns, worker
    shape, unit-less durations and missing required fields are flagged."""
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    mutate(doc)  # type: ignore[operator]
    messages = [e.message for e in _validator().iter_errors(doc)]
    assert any(fragment in m for m in messages), messages
