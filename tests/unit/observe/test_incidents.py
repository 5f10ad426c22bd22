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
