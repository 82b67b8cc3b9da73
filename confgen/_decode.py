"""Turn a YAML node tree into the typed model, collecting every error with its place.

The decoder is driven by the model's type hints and field specs, so the model stays the
single statement of what a topology may hold. It is strict where YAML 1.1 is loose: a
quoted "8000" is not a port, an unquoted `no` is not a string, 0755 is not a number.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from typing import Any, Literal, Union

import yaml

from ._fields import COMPILED, DURATION_HINT, PATTERNS, Duration, key_pattern, parse_duration, spec_of, yaml_key
from ._yaml import MAX_DEPTH, Mark, mark_of
from .errors import Diagnostic

MAX_EXPANDED_NODES = 500_000
# Aliases can repeat one bad mapping thousands of times: a 15 KB file produced 240,000
# errors and took seconds. Nobody reads past a few hundred; stop there.
MAX_ERRORS = 200

_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
_MERGE = "tag:yaml.org,2002:merge"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_KNOWN_TAGS = {_STR, _INT, _FLOAT, _BOOL, _NULL, _MERGE, _MAP, _SEQ}
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_MAX_INT_DIGITS = 30
_FLOAT_TEXT = re.compile(r"[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?")

_TAG_WORDS = {_INT: "a number", _FLOAT: "a number", _BOOL: "a boolean", _NULL: "null"}
# tags YAML 1.1 gives plain scalars on its own (a date, a lone `=`): what to call them in a message
_IMPLICIT_TAG_WORDS = {"tag:yaml.org,2002:timestamp": "a date", "tag:yaml.org,2002:value": "a value key"}


class _Invalid:
    """Marks a value that failed to decode (its error is already recorded)."""


INVALID = _Invalid()


class _TooManyErrors(Exception):
    """Raised inside the decoder once MAX_ERRORS have been recorded."""


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.:/@+-]{1,63}")


def path_join(parent: str, key: str) -> str:
    # A key from the file may hold anything (a newline would split a diagnostic line):
    # unusual keys are shown quoted, like values are.
    if not _PLAIN_KEY.fullmatch(key):
        return f"{parent}[{_show(key)}]"
    return f"{parent}.{key}" if parent else key


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _TooDeep(Exception):
    """The document nests deeper than MAX_DEPTH."""


def expanded_size(root: yaml.Node) -> int | None:
    """Nodes the document has once aliases are expanded; None for a recursive alias.

    Raises _TooDeep past MAX_DEPTH levels, before Python's recursion limit could be mistaken
    for a recursive alias.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int | None:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            return None
        if len(active) >= MAX_DEPTH:
            raise _TooDeep
        active.add(key)
        total = 1
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        for child in children:
            sub = size(child)
            if sub is None:
                return None
            total += sub
            if total > MAX_EXPANDED_NODES:
                break
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


class Decoder:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.diagnostics: list[Diagnostic] = []
        self.marks: dict[str, Mark] = {}
        # Set when a failed object or list was left out of its parent (which then holds a
        # default): cross-field checks would judge the default, so they must not run.
        self.dropped = False
        self.defaulted: list[str] = []  # leaves that failed and hold their default instead

    # -- reporting ---------------------------------------------------------------------
    def error(self, where: yaml.Node | Mark, path: str, message: str) -> _Invalid:
        mark = where if isinstance(where, Mark) else mark_of(where)
        self.diagnostics.append(Diagnostic(self.filename, mark.line, mark.col, path, message))
        if len(self.diagnostics) >= MAX_ERRORS:
            raise _TooManyErrors
        return INVALID

    # -- entry -------------------------------------------------------------------------
    def decode_root(self, node: yaml.Node, cls: type) -> Any:
        try:
            size = expanded_size(node)
        except _TooDeep:
            return self.error(node, "", f"the document nests more than {MAX_DEPTH} levels deep")
        if size is None:
            return self.error(node, "", "an alias refers to itself (recursive anchors are refused)")
        if size > MAX_EXPANDED_NODES:
            return self.error(
                node, "", f"the document expands to more than {MAX_EXPANDED_NODES:,} nodes through "
                "anchors and aliases (an alias bomb?)",
            )
        try:
            return self.decode(node, cls, "", None)
        except _TooManyErrors:
            mark = mark_of(node)
            self.diagnostics.append(Diagnostic(
                self.filename, mark.line, mark.col, "", f"stopped after {MAX_ERRORS} errors; fix these first"
            ))
            return INVALID

    def decode(self, node: yaml.Node, tp: Any, path: str, pattern: str | None) -> Any:
        self.marks.setdefault(path, mark_of(node))
        if node.tag not in _KNOWN_TAGS:
            implicit = _IMPLICIT_TAG_WORDS.get(node.tag) if isinstance(node, yaml.ScalarNode) else None
            if implicit is not None and not getattr(node, "style", None):  # no tag written: YAML resolved one
                return self.error(node, path, f"YAML reads the unquoted {_show(str(node.value))} as {implicit}: "
                                  "quote it if it is meant as text")
            return self.error(node, path, f"the tag {node.tag!r} is not allowed")
        origin = typing.get_origin(tp)
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if node.tag == _NULL:
                return None
            # `X | list[X]`: one item, or a list of them (a list node decodes as the list)
            lists = [a for a in args if typing.get_origin(a) is list]
            if lists and isinstance(node, yaml.SequenceNode):
                return self.decode(node, lists[0], path, pattern)
            return self.decode(node, args[0], path, pattern)
        if origin is Literal:
            return self._literal(node, tp, path)
        if origin is list:
            return self._list(node, typing.get_args(tp)[0], path, pattern)
        if origin is dict:
            return self._dict(node, path, pattern)
        if tp is bool:
            return self._bool(node, path)
        if tp is int:
            return self._int(node, path)
        if tp is float:
            return self._float(node, path)
        if tp is str:
            return self._str(node, path, pattern)
        if tp is Duration:
            return self._duration(node, path)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self._dataclass(node, tp, path)
        raise TypeError(f"model type {tp!r} has no decoder")  # a bug in the model, not input

    # -- scalars -----------------------------------------------------------------------
    def _scalar(self, node: yaml.Node, path: str, want: str) -> str | _Invalid:
        if not isinstance(node, yaml.ScalarNode):
            kind = "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
            return self.error(node, path, f"expected {want}, got {kind}")
        return str(node.value)

    def _str(self, node: yaml.Node, path: str, pattern: str | None) -> str | _Invalid:
        text = self._scalar(node, path, "a string")
        if isinstance(text, _Invalid):
            return text
        if node.tag != _STR:
            hint = ""
            if node.tag == _BOOL:
                hint = f" (YAML 1.1 reads an unquoted {text!r} as a boolean; quote it)"
            elif node.tag in (_INT, _FLOAT):
                hint = " (quote it if it is meant as text)"
            return self.error(node, path, f"expected a string, got {_TAG_WORDS[node.tag]} {text!r}{hint}")
        return self._check_pattern(node, path, text, pattern)

    def _check_pattern(self, node: yaml.Node, path: str, text: str, pattern: str | None) -> str | _Invalid:
        if pattern is None:
            # Free-form fields are still refused anything that could carry structure.
            if not re.fullmatch(r"[A-Za-z0-9._:\[\]/@+=-]{1,300}", text):
                return self.error(node, path, f"{_show(text)} has characters that are not allowed here")
            return text
        if not COMPILED[pattern].fullmatch(text):
            return self.error(node, path, f"{_show(text)} is not valid: expected {PATTERNS[pattern][1]}")
        return text

    def _bool(self, node: yaml.Node, path: str) -> bool | _Invalid:
        text = self._scalar(node, path, "true or false")
        if isinstance(text, _Invalid):
            return text
        if node.tag != _BOOL or text not in ("true", "false"):
            hint = " (YAML 1.1 spellings like yes/no/on/off are refused)" if node.tag == _BOOL else ""
            if _quoted(node):
                return self.error(node, path, f"expected true or false, {_got_string(text, text in ('true', 'false'))}")
            return self.error(node, path, f"expected true or false, got {_show(text)}{hint}")
        return text == "true"

    def _int(self, node: yaml.Node, path: str) -> int | _Invalid:
        text = self._scalar(node, path, "an integer")
        if isinstance(text, _Invalid):
            return text
        if _quoted(node):
            return self.error(node, path, f"expected an integer, {_got_string(text, bool(_DECIMAL.fullmatch(text)))}")
        if node.tag != _INT or not _DECIMAL.fullmatch(text):
            return self.error(node, path, f"expected a decimal integer, got {_show(text)}")
        if len(text.lstrip("+-").lstrip("0")) > _MAX_INT_DIGITS:
            # no field takes such a number; int() of 4,300+ digits would even raise
            return self.error(node, path, f"{_show(text)} is out of range (more than {_MAX_INT_DIGITS} digits)")
        return int(text)

    def _float(self, node: yaml.Node, path: str) -> float | _Invalid:
        text = self._scalar(node, path, "a number")
        if isinstance(text, _Invalid):
            return text
        if node.tag not in (_INT, _FLOAT) or not _FLOAT_TEXT.fullmatch(text):
            if _quoted(node):
                got = _got_string(text, bool(_FLOAT_TEXT.fullmatch(text)))
                return self.error(node, path, f"expected a number, {got}")
            return self.error(node, path, f"expected a number, got {_show(text)}")
        return float(text)

    def _duration(self, node: yaml.Node, path: str) -> Duration | _Invalid:
        text = self._scalar(node, path, DURATION_HINT)
        if isinstance(text, _Invalid):
            return text
        parsed = parse_duration(text) if node.tag == _STR else None
        if parsed is None:
            return self.error(node, path, f"expected {DURATION_HINT}, got {_show(text)}")
        return parsed

    def _literal(self, node: yaml.Node, tp: Any, path: str) -> str | _Invalid:
        choices = [str(c) for c in typing.get_args(tp)]
        text = self._scalar(node, path, "one of " + ", ".join(choices))
        if isinstance(text, _Invalid):
            return text
        if node.tag != _STR or text not in choices:
            near = difflib.get_close_matches(text, choices, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            return self.error(node, path, f"{_show(text)} is not one of: {', '.join(choices)}{hint}")
        return text

    # -- collections -------------------------------------------------------------------
    def _list(self, node: yaml.Node, item: Any, path: str, pattern: str | None) -> list[Any] | _Invalid:
        if not isinstance(node, yaml.SequenceNode):
            shown = f"{_show(str(node.value))} (write [item] for one item)"
            what = "a mapping" if isinstance(node, yaml.MappingNode) else shown
            return self.error(node, path, f"expected a list, got {what}")
        out: list[Any] = []
        ok = True
        for index, child in enumerate(node.value):
            value = self.decode(child, item, f"{path}[{index}]", pattern)
            ok = ok and not isinstance(value, _Invalid)
            out.append(value)
        return out if ok else INVALID

    def _dict(self, node: yaml.Node, path: str, pattern: str | None) -> dict[str, str] | _Invalid:
        pairs = self._pairs(node, path)
        if isinstance(pairs, _Invalid):
            return pairs
        out: dict[str, str] = {}
        ok = True
        for key, (key_node, value_node) in pairs.items():
            sub = path_join(path, key)
            if self._check_pattern(key_node, sub, key, key_pattern(pattern)) is INVALID:
                ok = False
                continue
            value = self.decode(value_node, str, sub, pattern)  # its tag checked, as every value's
            if isinstance(value, _Invalid):
                ok = False
            else:
                out[key] = value
        return out if ok else INVALID

    def _pairs(self, node: yaml.Node, path: str) -> dict[str, tuple[yaml.Node, yaml.Node]] | _Invalid:
        """A mapping's keys in order, with merge keys applied and duplicates refused."""
        if not isinstance(node, yaml.MappingNode):
            what = "a list" if isinstance(node, yaml.SequenceNode) else _show(str(node.value))
            return self.error(node, path, f"expected a mapping, got {what}")
        own: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        merged: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in sources:
                    if not isinstance(source, yaml.MappingNode):
                        return self.error(source, path, "a merge key (<<) takes a mapping or a list of mappings")
                    sub = self._pairs(source, path)
                    if isinstance(sub, _Invalid):
                        return sub
                    for key, pair in sub.items():
                        merged.setdefault(key, pair)
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR:
                return self.error(key_node, path, "mapping keys must be plain strings")
            key = str(key_node.value)
            if key in own:
                first = mark_of(own[key][0])
                self.error(key_node, path_join(path, key),
                           f"duplicate key {key!r} (first defined at line {first.line})")
                continue
            own[key] = (key_node, value_node)
        return {**merged, **own}

    def _dataclass(self, node: yaml.Node, cls: type, path: str) -> Any:
        shorthand = getattr(cls, "__shorthand__", None)
        if shorthand is not None and isinstance(node, yaml.ScalarNode):
            fld = next(f for f in dataclasses.fields(cls) if f.name == shorthand)
            value = self.decode(node, _hints(cls)[shorthand], path_join(path, shorthand), spec_of(fld).pattern)
            return INVALID if isinstance(value, _Invalid) else cls(**{shorthand: value})
        pairs = self._pairs(node, path)
        if isinstance(pairs, _Invalid):
            return pairs
        fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        # An unknown key or a bad optional field is reported, yet the object is still built
        # (with that field's default) so the cross-field checks can run on the rest.
        ok = True
        for key, (key_node, value_node) in pairs.items():
            if key.startswith("x-"):
                continue  # extension keys (as in Compose files): a place for anchors, ignored
            if key not in fields:
                near = difflib.get_close_matches(key, list(fields), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                self.error(key_node, path_join(path, key), f"unknown field{hint}")
                continue
            fld = fields[key]
            spec = spec_of(fld)
            sub = path_join(path, key)
            value = self.decode(value_node, hints[fld.name], sub, spec.pattern)
            valid = not isinstance(value, _Invalid) and self._check_range(
                value_node, sub, value, spec.minimum, spec.maximum, spec.min_items
            )
            if valid:
                kwargs[fld.name] = value
            elif _required(fld):
                ok = False
            elif isinstance(value_node, yaml.ScalarNode):
                self.defaulted.append(sub)
            else:
                self.dropped = True  # a whole subtree is missing from the model, not just a leaf
        for fld in dataclasses.fields(cls):
            if _required(fld) and fld.name not in kwargs and yaml_key(fld) not in pairs:
                self.error(node, path_join(path, yaml_key(fld)), "required field is missing")
                ok = False
        if not ok:
            self.dropped = True
            return INVALID
        return cls(**kwargs)

    def _check_range(self, node: yaml.Node, path: str, value: Any, lo: float | Duration | None,
                     hi: float | Duration | None, min_items: int | None) -> bool:
        if isinstance(value, list) and min_items is not None and len(value) < min_items:
            self.error(node, path, f"needs at least {min_items} item{'s' if min_items > 1 else ''}")
            return False
        if isinstance(value, Duration):
            written = node.value if isinstance(node, yaml.ScalarNode) else value
            if isinstance(lo, Duration) and value < lo:
                self.error(node, path, f"{written} is below the minimum {lo}")
                return False
            if isinstance(hi, Duration) and value > hi:
                self.error(node, path, f"{written} is above the maximum {hi}")
                return False
            return True
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            shown = node.value if isinstance(node, yaml.ScalarNode) else value  # as written in the file
            if isinstance(lo, int | float) and value < lo:
                self.error(node, path, f"{shown} is below the minimum {_num(lo)}")
                return False
            if isinstance(hi, int | float) and value > hi:
                self.error(node, path, f"{shown} is above the maximum {_num(hi)}")
                return False
        return True


def _required(fld: dataclasses.Field[Any]) -> bool:
    return fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def _quoted(node: yaml.Node) -> bool:
    """Whether a scalar was written in quotes (a plain `1e1` is a string too, but unquoted)."""
    return isinstance(node, yaml.ScalarNode) and node.style in ("'", '"')


def _got_string(text: str, fine_unquoted: bool) -> str:
    return f"got the string {_show(text)}" + ("; remove the quotes" if fine_unquoted else "")


def _show(text: str) -> str:
    """Quote a value for a message without letting control characters through."""
    shown = text if len(text) <= 60 else text[:57] + "..."
    return repr(shown)
