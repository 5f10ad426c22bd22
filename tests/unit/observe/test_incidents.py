"""What a run's loss of every live copy tells the user: the steps really trained again."""

from unbroken.observe.incidents import progress_lost, state_loss_text

LOST = {"kind": "state_lost", "generation": 4, "step": 0, "lost": 12, "reason": "every member that held step 12 is gone"}


def test_a_loss_the_job_went_on_from_a_checkpoint_after_names_the_checkpoints_step():
    # every member forgot its state (the sharded optimizer lost a part): the generation forms at step 0,
    # then its rank 0 reads the checkpoint of step 10
    (line,) = progress_lost([LOST, {"kind": "generation", "generation": 4}, {"kind": "resume", "step": 10, "location": "ck"}])
    assert "went on from step 10 though the job had reached step 12" in line
    assert "steps 10-11 are trained again" in line and "step 0" not in line
    assert "--checkpoint-dir" not in line


def test_a_loss_without_a_checkpoint_says_what_to_do_and_the_live_line_does_not_guess():
    (line,) = progress_lost([LOST])
    assert "went on from step 0" in line and "steps 0-11 are trained again" in line and "use --checkpoint-dir" in line
    live = state_loss_text(LOST)
    assert "formed at step 0" in live and "goes on from its newest checkpoint if there is one, else steps 0-11" in live


def test_each_loss_is_told_with_its_own_resume_not_a_later_losss():
    second = {**LOST, "generation": 9, "step": 0, "lost": 30}
    first_line, second_line = progress_lost([LOST, second, {"kind": "resume", "step": 25, "location": "ck"}])
    assert "went on from step 0" in first_line  # no checkpoint took it back (it went on from the best state left)
    assert "--checkpoint-dir" not in first_line  # though the job had checkpoints
    assert "went on from step 25" in second_line and "steps 25-29 are trained again" in second_line
