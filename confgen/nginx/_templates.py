"""The Jinja environment: templates shipped in the package, strict undefined, guard filters.

Installed from a wheel, the templates sit in `confgen/templates` (pyproject force-includes
the repository's top-level `templates/` there); in a source checkout or an editable
install they are read from the repository's `templates/` directory.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from ._guard import FILTERS


def templates_dir() -> Path:
    package = Path(__file__).resolve().parent.parent  # confgen/
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / "nginx").is_dir():
            return candidate
    raise FileNotFoundError(f"confgen templates not found next to {package}")


def environment() -> jinja2.Environment:
    """A fresh environment (cheap; no shared state between renders)."""
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
