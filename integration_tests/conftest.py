"""Session hooks of the integration tests: the whole-program jobs of the collected modules
start in the background once collection ends (:mod:`integration_tests._prefetch`)."""

from __future__ import annotations

import pytest

from integration_tests import _prefetch


def pytest_collection_finish(session: pytest.Session) -> None:
    _prefetch.start(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _prefetch.stop(session)
