"""The Jinja environment: templates shipped in the package, strict undefined, guard filters.

Installed from a wheel, the templates sit in `confgen/templates` (pyproject force-includes
the repository's top-level `templates/` there); in a source checkout or an editable
install they are read from the repository's `templates/` directory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jinja2

from ._guard import FILTERS


def templates_dir() -> Path:
    package = Path(__file__).resolve().parent.parent  # confgen/
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / "nginx").is_dir():
            return candidate
    raise FileNotFoundError(f"confgen templates not found next to {package}")


class Templates:
    """The nginx templates, compiled once: one per renderer call or per long-lived user (the
    nginx sidecar keeps one for every upstream write). Building the environment and compiling
    a template is most of a render's time, so it is not redone per file; there is no
    module-level cache either (no shared state between users)."""

    def __init__(self) -> None:
        self._env = environment()
        self._compiled: dict[str, jinja2.Template] = {}

    @property
    def filters(self) -> dict[str, Callable[..., Any]]:
        return self._env.filters

    def render(self, name: str, context: Mapping[str, Any]) -> str:
        template = self._compiled.get(name)
        if template is None:
            template = self._compiled[name] = self._env.get_template(name)
        return template.render(context)


def environment() -> jinja2.Environment:
    """A fresh environment (no shared state between its users)."""
    # autoescape is for HTML; nginx needs the guard filters instead (FILTERS).
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        autoescape=False,  # noqa: S701 (nginx config, not HTML: the guard filters apply)
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(FILTERS)
    return env
