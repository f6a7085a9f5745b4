"""Fixtures of the driver tests."""

from __future__ import annotations

import pytest

import driver.session


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if the driver gets as far as starting (or joining) Ray."""

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(driver.session, "ray_session", refuse)
