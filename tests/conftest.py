"""Shared fixtures: pools of real gloo processes, started once per session and reused."""

from __future__ import annotations

import pytest

from zeroshard.testing import Workers


@pytest.fixture(scope="session")
def workers2():
    with Workers(2) as w:
        yield w


@pytest.fixture(scope="session")
def workers4():
    with Workers(4) as w:
        yield w
