"""YAML syntax errors are said in the topology author's terms, at the right place, with the
parser's own words kept in brackets."""

from __future__ import annotations

import pytest

from confgen.errors import TopologyError
from confgen.topology import parse

CASES = [
    ("version: 1\nname: x\n  bad: [\n", 3, "check this line's indentation"),
    ('version: 1\nname: "x\n', 3, "a quoted string is never closed"),
    ("version: 1\n\tname: x\n", 2, "a tab is used here; YAML indents with spaces only"),
    ("pools:\n  - name: a\n   workers: [x]\n", 3, "list items start with '- ' at the same indentation"),
    ("a: &x 1\nb: *y\n", 2, "refers to an anchor '&name' that is not defined"),
    ("a: @foo\n", 1, "a value cannot start with '@' unquoted"),
    ("a: [1, 2\nb: 3\n", 2, "a [ ... ] list is not closed with ']'"),
    ("a:\n  b: 1\n c: 2\n", 3, "this line does not fit the mapping above it"),
]


@pytest.mark.parametrize(("text", "line", "words"), CASES, ids=[c[2][:30] for c in CASES])
def test_yaml_syntax_error_is_explained(text: str, line: int, words: str) -> None:
    """Each common YAML mistake gets a sentence saying what to fix, on the line where it is."""
    with pytest.raises(TopologyError) as caught:
        parse(text.encode(), "topo.yaml")
    (diag,) = caught.value.diagnostics
    assert diag.line == line
    assert diag.message.startswith("YAML syntax error: ")
    assert words in diag.message
    assert diag.message.endswith("]")  # the parser's own words are kept
