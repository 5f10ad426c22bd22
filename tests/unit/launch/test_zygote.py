"""The zygote that forks workers: a forked worker runs its script as ``python SCRIPT`` would, its
exit status and signal come back as a Popen's, it has its own session or process group, and
nothing is left behind when the zygote or a worker dies."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from unbroken.launch.zygote import PER_WORKER, Zygote, ZygoteError

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    print(json.dumps({
        "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
        "member": os.environ.get("UNBROKEN_MEMBER_ID"), "same_env": os.environ.get("SHARED"),
        "sid": os.getsid(0), "pgid": os.getpgid(0), "pid": os.getpid(),
        "threads": torch.get_num_threads(), "cuda": torch.cuda.is_initialized(),
        "comm": open("/proc/self/comm").read().strip(),
        "cmdline": open("/proc/self/cmdline").read().rstrip("\\0").replace("\\0", " "),
        "in_flight": sys.exc_info()[0] is not None,
        "optimizer_imports": "torch._dynamo" in sys.modules,
        "frozen": __import__("gc").get_freeze_count(),
    }), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def zygote():
    env = {**os.environ, "SHARED": "yes", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    made = Zygote(env)
    yield made
    made.close()


def _output(proc) -> list[str]:
    return proc.stdout.read().decode().splitlines()


def _errors(proc) -> list[str]:
    return proc.stderr.read().decode().splitlines()


def test_a_forked_worker_runs_its_script_as_python_would_and_its_exit_status_comes_back(zygote, tmp_path):
    import json

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**zygote.env, "UNBROKEN_MEMBER_ID": "n.w0.r0"}
    started = time.monotonic()
    proc = zygote.start([str(script), "3"], False, env)
    assert proc.wait(timeout=60) == 3
    lines = _output(proc)
    seen = json.loads(lines[0])
    assert seen["name"] == "__main__" and seen["argv"] == [str(script), "3"]
    assert seen["path0"] == str(tmp_path) and seen["cwd"] == os.getcwd()
    assert seen["member"] == "n.w0.r0" and seen["same_env"] == "yes"
    assert seen["sid"] == seen["pid"] == proc.pid  # a session of its own, as start_new_session gives
    assert seen["threads"] == 1 and seen["cuda"] is False
    # what a torch optimizer's constructor imports (1.4 s of CPU) came with the fork
    assert seen["optimizer_imports"] is True
    # and the inherited heap is frozen: the worker's collections (its last at exit) skip it
    assert seen["frozen"] > 100_000
    with open(f"/proc/{zygote.proc.pid}/comm") as f:  # the zygote is told apart by its name
        assert f.read().strip() == "unbroken-zygote"
    assert _errors(proc) == ["to stderr"]  # stderr has a pipe of its own, as under Popen
    assert seen["comm"] == os.path.basename(sys.executable)[:15]  # its interpreter's name, not the zygote's
    assert seen["cmdline"].split() == [sys.executable, str(script), "3"]  # ps and pgrep -f find it by its script
    assert seen["in_flight"] is False  # the script runs outside the zygote's exception handler
    assert time.monotonic() - started < 60


def test_a_module_runs_as_python_dash_m_would(zygote, tmp_path, monkeypatch):
    import json

    (tmp_path / "trainmod.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    proc = zygote.start(["trainmod", "0"], True, dict(zygote.env))
    assert proc.wait(timeout=60) == 0
    seen = json.loads(_output(proc)[0])
    assert seen["name"] == "__main__" and seen["argv"][0] == str(tmp_path / "trainmod.py")
    assert seen["path0"] == str(tmp_path)


def test_a_worker_killed_by_a_signal_reports_it_as_popen_does_and_a_traceback_exits_1(zygote, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = zygote.start([str(sleeper)], False, dict(zygote.env))
    assert proc.stdout.readline() == b"up\n"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    failing = tmp_path / "fail.py"
    failing.write_text("raise ValueError('a bad setting')\n")
    proc = zygote.start([str(failing)], False, dict(zygote.env))
    assert proc.wait(timeout=30) == 1
    lines = _errors(proc)
    # the traceback python failing.py prints: the script's frames only, nothing chained
    assert lines == ["Traceback (most recent call last):", f'  File "{failing}", line 1, in <module>',
                     "    raise ValueError('a bad setting')", "ValueError: a bad setting"], lines
    ddp = tmp_path / "ddp.py"  # every DDP script's first call
    ddp.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    env = {k: v for k, v in zygote.env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = zygote.start([str(ddp)], False, env)
    assert proc.wait(timeout=30) == 1
    last = _errors(proc)[-1]
    assert "Remove dist.init_process_group(...), DDP(model)" in last and "RANK expected" not in last, last
    zero = tmp_path / "zero.py"  # a sharded optimizer, whose shards would die with their ranks
    zero.write_text("import torch\nfrom torch.distributed.optim import ZeroRedundancyOptimizer\n"
                    "ZeroRedundancyOptimizer(torch.nn.Linear(2, 2).parameters(), optimizer_class=torch.optim.AdamW)\n")
    proc = zygote.start([str(zero)], False, env)
    assert proc.wait(timeout=30) == 1
    last = _errors(proc)[-1]
    assert "ZeroRedundancyOptimizer under `unbroken run`" in last and "Default process group" not in last, last


def test_a_replica_groups_processes_share_one_process_group(zygote, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    first = zygote.start([str(sleeper)], False, dict(zygote.env), 0)
    second = zygote.start([str(sleeper)], False, dict(zygote.env), first.pid)
    assert os.getpgid(first.pid) == os.getpgid(second.pid) == first.pid
    assert os.getsid(first.pid) == os.getsid(0)  # the launcher's session, as Popen's process_group gives
    os.killpg(first.pid, signal.SIGKILL)
    assert first.wait(timeout=30) == second.wait(timeout=30) == -signal.SIGKILL


def test_an_environment_that_differs_beyond_the_per_worker_variables_is_not_forked(zygote):
    assert zygote.can_start({**zygote.env, **{name: "x" for name in PER_WORKER}})
    assert not zygote.can_start({**zygote.env, "PYTHONHASHSEED": "7"})
    assert not zygote.can_start({k: v for k, v in zygote.env.items() if k != "SHARED"})


def test_when_the_zygote_dies_its_workers_are_killed_and_reported_and_starting_fails_clearly(zygote, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = zygote.start([str(sleeper)], False, dict(zygote.env))
    assert proc.stdout.readline() == b"up\n"
    zygote.proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not _gone(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(proc.pid)
    assert not zygote.can_start(dict(zygote.env))
    with pytest.raises(ZygoteError, match="gone|ended"):
        zygote.start([str(sleeper)], False, dict(zygote.env))


def test_a_workers_parent_death_signal_follows_the_zygote(zygote, tmp_path):
    """The worker's own die-with-launcher check reads UNBROKEN_LAUNCHER_PID: for a forked worker
    that is the zygote, its parent (which dies with the launcher)."""
    script = tmp_path / "pid.py"
    script.write_text("import os\nprint(os.environ['UNBROKEN_LAUNCHER_PID'], os.getppid(), flush=True)\n")
    proc = zygote.start([str(script)], False, {**zygote.env, "UNBROKEN_LAUNCHER_PID": str(os.getpid())})
    assert proc.wait(timeout=30) == 0
    launcher, parent = _output(proc)[0].split()
    assert launcher == parent == str(zygote.proc.pid)


def _gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (gone, or a zombie waiting for init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_ctrl_c_or_sigterm_to_the_launchers_process_group_spares_the_zygote_not_the_workers(zygote, tmp_path):
    """Ctrl-C reaches the zygote with the launcher; were it to die, it would take every worker
    with it at once, before the launcher's graceful shutdown. A worker keeps the usual dispositions."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = zygote.start([str(script)], False, dict(zygote.env))
    assert proc.stdout.readline() == b"up\n"
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        os.kill(zygote.proc.pid, sig)
    # the zygote forks once more after the signals (delivered before it reads the request): alive
    interrupted = zygote.start([str(script)], False, dict(zygote.env))
    assert interrupted.stdout.readline() == b"up\n"
    assert zygote.proc.poll() is None and proc.poll() is None
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    os.kill(interrupted.pid, signal.SIGINT)  # as in a fresh interpreter: KeyboardInterrupt, then death by SIGINT
    assert interrupted.wait(timeout=30) == -signal.SIGINT and b"KeyboardInterrupt" in interrupted.stderr.read()
