"""Faults on scripts that do not behave like unbroken's own loop (issue 44):
``python tests/soak/script_shapes.py --seeds 12``.

Each seed picks a script shape (a learning rate set by hand as nanoGPT does, a clamp after each
commit, a stop decided by the leader at one step only, an evaluation through ``job.on_leader``,
or the plain loop) and a schedule whose first fault restarts a worker and whose next ones land
while it catches up or is healed (``kill@donate``, ``fail@donate``, ``kill@heal``, a kill or a
failed collective a step or two later). Every run must end with the shared invariant checker and
the single-process model of the same shape (1e-8). Prints one line per seed and a summary; exits
1 if any seed broke an invariant. Run from the repository root."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from testbed import harness  # noqa: E402
from tests.soak.compound import checked, summary  # noqa: E402

STEPS, GLOBAL, STOP_AT = 40, 24, 25

SHAPES = {
    "plain": [],
    "manual-lr": ["--manual-lr"],
    "clamp": ["--clamp", "0.25"],
    "leader-stop": ["--stop-at", str(STOP_AT), "--stop-once"],
    "on-leader-eval": ["--eval-every", "7"],
}
"""Script arguments of each shape (testbed/scripts/train_exact.py)."""

LATER = ("kill@donate", "fail@donate", "kill@heal", "kill@step", "fail@allreduce")


def schedule(seed: int, workers: int = 3) -> tuple[str, str]:
    """(shape, chaos) for ``seed``: a worker killed early (it restarts and rejoins), then one or
    two faults aimed at its catch-up or heal, or at the steps right after."""
    rng = random.Random(seed)
    shape = sorted(SHAPES)[rng.randrange(len(SHAPES))]
    first = rng.randint(3, 8)
    faults = [f"kill@step,rank={rng.randrange(workers)},step={first}"]
    for _ in range(rng.choice((1, 2))):
        kind = rng.choice(LATER)
        step = first + rng.randint(1, 6)
        faults.append(f"{kind},step={step}" if "donate" in kind or "heal" in kind else f"{kind},rank={rng.randrange(workers)},step={step}")
    return shape, ";".join(faults)


def one(seed: int, references: dict, workdir: str) -> dict:
    shape, chaos = schedule(seed)
    run_dir = os.path.join(workdir, f"seed{seed}")
    args = list(SHAPES[shape])
    if shape == "on-leader-eval":
        args += ["--eval-log", os.path.join(run_dir + "-evals.jsonl")]

    def run_seed(outcome: dict) -> None:
        run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--max-restarts", "4", "--record-samples",
                               "--heartbeat-timeout", "2", "--chaos", chaos, harness.EXACT, "--steps", str(STEPS),
                               "--step-delay", "0.2", *args, "--out", f"{run_dir}/final", timeout=300)
        outcome["fired"] = [f"{f['fault']}@{f['point']}:{f['step']}" for f in run.events("fault")]
        outcome["catch_ups"] = [{"verified": e.get("verified"), "error": e.get("error")} for e in run.events("catch_up")]
        assert run.code == 0, f"exit {run.code}: {run.stderr[-500:]}"
        harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
        steps = STOP_AT + 1 if shape == "leader-stop" else STEPS
        outcome.update(harness.check_exactly_once(run_dir, steps, GLOBAL))
        outcome["max_relative_difference"] = harness.check_same_model(f"{run_dir}/final", references[shape],
                                                                      harness.finished_members(run_dir))

    return checked({"seed": seed, "shape": shape, "chaos": chaos}, run_seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12, help="how many seeds (default 12)")
    parser.add_argument("--first", type=int, default=1, help="the first seed (default 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        references = {}
        for shape, script in SHAPES.items():
            extra = ["--eval-log", os.path.join(workdir, f"{shape}-single.jsonl")] if shape == "on-leader-eval" else []
            references[shape] = harness.single_process(os.path.join(workdir, f"single-{shape}"), "--steps", str(STEPS),
                                                       *script, *extra)
        results = []
        for seed in range(args.first, args.first + args.seeds):
            results.append(one(seed, references, workdir))
            print(json.dumps(results[-1]), flush=True)
    return summary(results, catch_ups=sum(len(r.get("catch_ups", [])) for r in results),
                   unverified_catch_ups=sum(1 for r in results for c in r.get("catch_ups", []) if not c["verified"]))


if __name__ == "__main__":
    sys.exit(main())
