"""YAML syntax errors in our own words.

PyYAML's messages name the parser's state ("while parsing a block collection: did not find
expected '-' indicator"); a person editing a topology wants to know what to change on the
line it points at. Each rule matches the parser's problem (and, where it matters, its
context) and says what is most likely wrong, in the file's terms. The parser's own text is
kept at the end in brackets, so nothing it knew is lost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["explain"]


@dataclass(frozen=True, slots=True)
class _Rule:
    problem: re.Pattern[str]
    context: re.Pattern[str] | None
    words: str


def _rule(problem: str, words: str, context: str | None = None) -> _Rule:
    return _Rule(re.compile(problem), re.compile(context) if context else None, words)


_RULES = (
    _rule(r"found (a tab character|character '\\t')", "a tab is used here; YAML indents with spaces only"),
    _rule(r"found character .\\t. that cannot start any token",
          "a tab is used here; YAML indents with spaces only"),
    _rule(r"found unexpected end of stream", "a quoted string is never closed: add the closing quote",
          r"quoted scalar"),
    _rule(r"found unknown escape character", "an unknown backslash escape inside a double-quoted string: "
          "use single quotes, or write the backslash twice"),
    _rule(r"mapping values are not allowed here|mapping values are not allowed in this context",
          "a 'key: value' where none can start: check this line's indentation against the line above, "
          "or quote a value that contains ': '"),
    _rule(r"did not find expected '-' indicator",
          "this line does not line up with the list above it: list items start with '- ' at the same "
          "indentation"),
    _rule(r"did not find expected key",
          "this line does not fit the mapping above it: check its indentation (a '- ' item cannot stand "
          "among 'key: value' lines at the same level)"),
    _rule(r"did not find expected ',' or '\]'", "a [ ... ] list is not closed with ']' or its items are not "
          "separated by ','"),
    _rule(r"did not find expected ',' or '\}'", "a { ... } mapping is not closed with '}' or its entries are "
          "not separated by ','"),
    _rule(r"could not find expected ':'", "a line inside a mapping without 'key: value' (is a ':' missing, "
          "or does the line belong to the value above and need quoting?)"),
    _rule(r"expected <block end>, but found", "the indentation of this line does not match the block it is "
          "in: line it up with its siblings"),
    _rule(r"found undefined alias", "'*name' refers to an anchor '&name' that is not defined"),
    _rule(r"found character '([@`%|>!&*])' that cannot start any token|found character that cannot start any token",
          "a value cannot start with {char} unquoted: put the value in quotes"),
    _rule(r"expected alphabetic or numeric character", "an anchor or alias ('&' or '*') without a name: "
          "quote the value if '&' or '*' is meant literally"),
    _rule(r"found duplicate anchor", "the same '&anchor' is defined twice"),
)


def explain(problem: str | None, context: str | None, char: str = "") -> str:
    """One sentence saying what to fix, followed by the parser's own words in brackets.

    `char` is the character at the place the parser stopped, when known.
    """
    raw = ": ".join(part for part in (context, problem) if part) or "invalid YAML"
    if char == "\t":
        return f"YAML syntax error: a tab is used here; YAML indents with spaces only [{raw}]"
    for rule in _RULES:
        if rule.problem.search(problem or raw) and (rule.context is None or rule.context.search(context or "")):
            words = rule.words.replace("{char}", repr(char) if char.strip() else "this character")
            return f"YAML syntax error: {words} [{raw}]"
    return f"YAML syntax error: {raw}"
