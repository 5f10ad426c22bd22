"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture
def launched(monkeypatch):
    """The settings `unbroken run` would launch with (the launcher itself is not started)."""
    seen = {}

    class FakeLauncher:
        def __init__(self, settings):
            seen["settings"] = settings

        def run(self):
            return 0

    monkeypatch.setattr("unbroken.launch.launcher.Launcher", FakeLauncher)
    return seen
