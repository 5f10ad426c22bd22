"""The workload under Ray Train 2.60: TorchTrainer with FailureConfig and checkpoint restore.

This is the driver: it starts a local Ray cluster with 3 CPUs, runs the trainer, and shuts the
cluster down when the run ends or it is told to stop (SIGTERM). Each worker reports a
checkpoint (model, optimizer, step) every ``--checkpoint-every`` steps through
``ray.train.report``; after a failure Ray restarts every worker, which restore the last
checkpoint Ray committed, and the data position follows from the step.
"""

import os
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import StepLog, arguments, batch, setup, share  # noqa: E402


def train_loop(cfg: dict) -> None:
    import time

    started = time.time()
    import ray.train
    import ray.train.torch
    import torch

    log = StepLog(cfg["log"], start=started)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x, y, model, optimizer = setup(cfg["width"])
    model = ray.train.torch.prepare_model(model)  # DDP over Gloo on CPU
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        log.write("resume", step=step)
    loss_fn = torch.nn.CrossEntropyLoss()
    while cfg["steps"] == 0 or step < cfg["steps"]:
        a, b = share(step, rank, world, cfg["global_batch"])
        xb, yb = batch(x, y, a, b)
        loss_fn(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.step(step, rank, world, [(a, b)])
        step += 1
        if step % cfg["checkpoint_every"] == 0:
            if rank == 0:
                with tempfile.TemporaryDirectory() as d:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, os.path.join(d, "state.pt"))
                    ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))
            else:
                ray.train.report({"step": step}, checkpoint=None)
    log.write("done")


def main() -> int:
    def extra(parser):
        parser.add_argument("--checkpoint-every", type=int, default=20)
        parser.add_argument("--storage", required=True)

    args = arguments(extra)
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # the workers import this file's neighbours (workload, plan) like the driver
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=3, include_dashboard=False)
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"log": args.step_log, "steps": args.steps, "global_batch": args.global_batch, "width": args.width, "checkpoint_every": args.checkpoint_every},
            scaling_config=ray.train.ScalingConfig(num_workers=3, use_gpu=False),
            run_config=ray.train.RunConfig(
                name="bench",
                storage_path=args.storage,
                failure_config=ray.train.FailureConfig(max_failures=1000),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=3),
            ),
        )
        result = trainer.fit()
        return 0 if result.error is None else 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
