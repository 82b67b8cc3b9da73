"""One Campaign per session; the full run (CONFGEN_FAULTS_FULL=1) writes docs/reliability.md."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults._campaign import FULL, Campaign


@pytest.fixture(scope="session")
def campaign() -> Iterator[Campaign]:
    record = Campaign()
    yield record
    if FULL and record.rows:
        record.write_doc()
