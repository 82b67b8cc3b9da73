"""One Campaign per session; the full run (CONFGEN_FAULTS_FULL=1) writes docs/reliability.md."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.faults._campaign import FULL, Campaign


@pytest.fixture(scope="session")
def campaign() -> Iterator[Campaign]:
    if FULL and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail("CONFGEN_FAULTS_FULL=1 writes docs/reliability.md from the whole campaign: run it in one "
                    "process (pytest -p no:xdist tests/faults, or make test PYTEST_WORKERS=0)", pytrace=False)
    record = Campaign()
    yield record
    if FULL and record.rows:
        record.write_doc()
