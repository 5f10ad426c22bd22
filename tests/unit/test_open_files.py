"""The open-file limit is raised to the hard limit, and a job too large even for that is named."""

from __future__ import annotations

import logging
import resource

import pytest

from unbroken import open_files


@pytest.fixture
def restore_limit():
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield before
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_soft_limit_is_raised_to_the_hard_limit(restore_limit):
    soft, hard = restore_limit
    low = min(512, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    now = open_files.raise_limit(10, "a test")
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now
    assert now == (hard if hard != resource.RLIM_INFINITY else max(low, 1 << 20))


def test_a_job_beyond_the_hard_limit_is_warned_about_with_the_fix(restore_limit, caplog):
    soft, hard = restore_limit
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        open_files.raise_limit(limit, "a coordinator of 9 members")
    assert "a coordinator of 9 members needs about" in caplog.text and "ulimit -n" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        open_files.raise_limit(10, "a small job")
    assert caplog.text == ""
