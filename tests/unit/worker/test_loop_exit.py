"""How the script's loop over the steps was left (unbroken.worker.loop_exit): break or return,
which ends the job at a boundary, or an exception, which is a failure and never a stop."""

from __future__ import annotations

import pytest

from unbroken.worker import loop_exit


def _steps(seen):
    try:
        yield 1
        yield 2
    except GeneratorExit:
        seen.append(loop_exit.left_by_exception())
        raise


def _break(seen):
    for _ in _steps(seen):
        break


def _return(seen):
    for _ in _steps(seen):
        if True:
            return 1


def _raise(seen):
    for _ in _steps(seen):
        raise ValueError("boom")


def _raise_in_a_call(seen):
    for _ in _steps(seen):
        int("not a number")


@pytest.mark.parametrize("loop, by_exception", [(_break, False), (_return, False), (_raise, True), (_raise_in_a_call, True)])
def test_a_break_or_return_is_told_from_an_exception(loop, by_exception):
    seen = []
    try:
        loop(seen)
    except ValueError:
        pass
    assert seen == [by_exception]
