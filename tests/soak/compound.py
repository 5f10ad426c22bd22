"""Many seeds of compound faults (issue 26): ``python tests/soak/compound.py --seeds 30``.

Each seed runs the 3-worker job of ``tests/integration/test_compound_faults.py`` under the
schedule :func:`tests.integration.compound.schedule` draws from it, then the shared invariant
checker and the single-process model. Prints one line per seed and a summary; exits 1 if any
seed broke an invariant. Run from the repository root."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from testbed import harness  # noqa: E402
from tests.integration import compound

STEPS, GLOBAL = 40, 24


def checked(outcome: dict, run_seed: Callable[[dict], None]) -> dict:
    """``run_seed(outcome)`` for one seed, which fills ``outcome`` and raises if the seed broke an
    invariant: ``outcome`` with ``ok``, the error if any, and the seconds it took. One seed's
    failure is reported, and the others still run."""
    started = time.monotonic()
    try:
        run_seed(outcome)
        outcome["ok"] = True
    except BaseException as exc:  # one seed's failure is reported, the others still run
        outcome.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:800])
        traceback.print_exc()
    outcome["seconds"] = round(time.monotonic() - started, 1)
    return outcome


def summary(results: list[dict], **extra: Any) -> int:
    """Print the soak's last line (seeds, passed, failed, faults fired, ``extra``); its exit status."""
    failed = [r["seed"] for r in results if not r["ok"]]
    print(json.dumps({"seeds": len(results), "passed": len(results) - len(failed), "failed": failed,
                      "faults_fired": sum(len(r.get("fired", [])) for r in results), **extra}))
    return 1 if failed else 0


def one(seed: int, single: dict, workdir: str) -> dict:
    chaos = compound.schedule(seed, workers=3, steps=STEPS)
    run_dir = os.path.join(workdir, f"seed{seed}")

    def run_seed(outcome: dict) -> None:
        run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--record-samples", "--heartbeat-timeout", "2",
                               "--chaos", chaos, harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.1",
                               "--out", f"{run_dir}/final", timeout=300)
        outcome["fired"] = [f"{f['fault']}@{f['point']}:{f['step']}" for f in run.events("fault")]
        assert run.code == 0, f"exit {run.code}: {run.stderr[-500:]}"
        harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
        outcome.update(harness.check_exactly_once(run_dir, STEPS, GLOBAL))
        outcome["max_relative_difference"] = harness.check_same_model(f"{run_dir}/final", single, harness.finished_members(run_dir))

    return checked({"seed": seed, "chaos": chaos}, run_seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    parser.add_argument("--first", type=int, default=1, help="the first seed (default 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        single = harness.single_process(os.path.join(workdir, "single"), "--steps", str(STEPS))
        results = []
        for seed in range(args.first, args.first + args.seeds):
            results.append(one(seed, single, workdir))
            print(json.dumps(results[-1]), flush=True)
    return summary(results)


if __name__ == "__main__":
    sys.exit(main())
