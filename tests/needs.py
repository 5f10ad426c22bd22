"""What a test needs from the machine (etcd, root, network namespaces) and what happens without it.

On a developer's machine a test whose needs are missing skips with the reason. Under
``UNBROKEN_CI=1`` (set by ``.ci/run``, whose machine has all of them) it fails instead, naming
what is missing: there a skip would mean a broken install, and a test that passes by not running.
GPU tests are not covered: CI has no GPU, and they keep skipping (the run says so in one line).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

CI = os.environ.get("UNBROKEN_CI") == "1"


def _failure(reason: str) -> str:
    return f"UNBROKEN_CI=1 and this test cannot run: {reason}. CI installs it; a skip here would hide a broken install"


def needs(reason: str | None) -> pytest.MarkDecorator:
    """A mark for a test that cannot run when ``reason`` is not None: a skip, or under CI a failure
    (raised by ``tests/conftest.py`` before the test's fixtures are set up)."""
    if reason is None:
        return pytest.mark.needs_available
    return pytest.mark.needs_missing(_failure(reason)) if CI else pytest.mark.skip(reason=reason)


def require(reason: str | None) -> None:
    """Inside a test or fixture: skip (or under CI fail) when ``reason`` is not None."""
    if reason is None:
        return
    if CI:
        pytest.fail(_failure(reason), pytrace=False)
    pytest.skip(reason)


def module(name: str) -> ModuleType:
    """``pytest.importorskip`` for a test dependency that ``.[test]`` installs: under CI a missing
    one fails."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(f"cannot import {name} ({exc}); pip install -e '.[test]'")
        raise  # not reached: require skips or fails
