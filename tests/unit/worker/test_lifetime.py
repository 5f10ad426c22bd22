"""How a worker process ends: a wait left behind on a helper thread never turns a finish into a crash."""

import subprocess
import sys
import textwrap
import threading
import time

from unbroken.worker import blocking_waits

SCRIPT = textwrap.dedent("""
    import datetime, sys, time
    import torch.distributed as dist
    from unbroken.worker import blocking_waits
    from unbroken.worker.lifetime import ExitGuard

    class Job:  # what the guard reads of a job: no abandoned group, no replica group
        _graveyard = []
        _group = None

    class Work:  # a wait that blocks in C++ with the GIL released, as Gloo's recv does
        def __init__(self, store):
            self.store = store
        def wait(self):
            self.store.wait(["never"])

    class SlowTeardown:  # the interpreter's teardown takes longer than the wait left behind
        def __del__(self):
            time.sleep(1.5)

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=0.5))
    ExitGuard.install(Job())
    blocking_waits.wait_in_thread(Work(store), lambda: None)
    time.sleep(0.1)
    assert blocking_waits.in_flight() == 1
    ExitGuard.finished = True
    teardown = SlowTeardown()
    print("finished", flush=True)
""")


def test_a_wait_left_behind_that_returns_during_teardown_does_not_abort_a_finished_process():
    """The CI failure of a replica-group heal that hung part-way: the wait on the hung peer was
    left behind, returned while the interpreter was torn down, and the process aborted with
    SIGABRT ("terminate called without an active exception") after it had finished."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert "finished" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_waits_in_flight_are_counted_until_they_return():
    class Work:
        def __init__(self):
            self.release = threading.Event()

        def wait(self):
            assert self.release.wait(10)

    work = Work()
    before = blocking_waits.in_flight()
    outcome = blocking_waits.wait_in_thread(work, lambda: None)
    assert blocking_waits.in_flight() == before + 1
    work.release.set()
    deadline = time.monotonic() + 10
    while blocking_waits.in_flight() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outcome == [None]
    assert blocking_waits.in_flight() == before
