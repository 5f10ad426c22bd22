"""Start-up (issue 17): members that built the same model from the same seed are not healed at
step 0; the run still equals a single process."""

import pytest

from testbed import harness

pytestmark = pytest.mark.slow


def test_members_that_start_alike_are_not_healed_and_still_equal_a_single_process(reference):
    run = reference["healthy_run"]
    generations = run.events("generation")
    assert generations and len(generations[0]["members"]) == 4
    assert not run.events("heal"), run.events("heal")
    assert harness.max_relative_difference(reference["healthy"], reference["single"]) < 1e-8
    assert len({e["hash"] for e in run.events("replicas")}) == 1
