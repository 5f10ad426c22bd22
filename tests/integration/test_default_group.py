"""Inside the loop ``torch.distributed`` answers with the generation (issue 27): ``get_rank()``,
``get_world_size()``, ``RANK`` and ``WORLD_SIZE`` give the member's index and the generation's
size (asserted by the script in every step), a torchmetrics metric synced over the default group
equals the step's global loss on every member, a rank-zero-only logger prints once per step
(on the leader, whichever worker that is), and a kill in the middle of the metric's sync makes
the step be redone, not fail the job."""

import json
import os
import re

import pytest

from testbed import harness
from testbed.harness import GLOBAL
from tests.needs import module

pytestmark = [pytest.mark.slow]
STEPS = 16


def test_metrics_synced_over_the_default_group_and_a_rank_zero_logger_follow_the_generation(tmp_path):
    module("torchmetrics")
    run_dir = str(tmp_path / "run")
    log = str(tmp_path / "metrics.jsonl")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "3", "--record-samples", "--chaos", "kill@step,rank=0,step=6",
        harness.EXACT, "--steps", str(STEPS), "--metrics-log", log, "--micro-delay", "0.02", "--out", f"{run_dir}/final",
        timeout=240,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    single = harness.single_process(str(tmp_path / "single"), "--steps", str(STEPS), "--metrics-log", str(tmp_path / "single.jsonl"))
    harness.check_same_model(f"{run_dir}/final", single, harness.finished_members(run_dir))
    records = [json.loads(line) for line in open(log)]
    assert {r["step"] for r in records} == set(range(STEPS))
    for r in records:  # the synced metric is the mean over the whole global batch: the step's loss
        assert abs(r["synced"] - r["loss"]) <= 1e-12 * max(1.0, abs(r["loss"])), r
    assert any(r["members"] == 2 for r in records), "the kill did not leave a smaller generation"
    logs = "".join(open(os.path.join(run_dir, "workers", name)).read() for name in os.listdir(os.path.join(run_dir, "workers"))
                   if name.endswith(".log"))
    printed = [int(m) for m in re.findall(r"^RZ step (\d+) mse \S+ rank 0$", logs, re.M)]
    assert sorted(printed) == list(range(STEPS)), printed  # once per step, on the member of rank 0
    assert "RZ step" in run.stdout, "the leader's rank-zero lines reach the console"
    shown = [line for line in run.stdout.splitlines() if "RZ step" in line]
    assert all(re.match(r"\[w\d leader\] RZ step", line) for line in shown), shown  # under the leader's tag
