"""A collective waited for briefly inside torch (unbroken/worker/blocking_waits.py): done, still
running (the work is left intact), or failed, told apart; two real Gloo processes."""

import os
import socket
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from unbroken.worker.blocking_waits import PENDING, wait_briefly
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    pg = dist.ProcessGroupGloo(dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=__import__("datetime").timedelta(seconds=30)), rank, 2)
    t = torch.ones(10)
    if rank == 1:
        time.sleep(0.3)  # rank 0's brief wait ends first
    w = pg.allreduce([t])
    first = wait_briefly(w, w.get_future(), 0.02)
    w.wait()
    w = pg.allreduce([t])
    second = wait_briefly(w, w.get_future(), 10)
    if rank == 1:
        os._exit(0)  # a dead peer
    time.sleep(0.3)
    w = pg.allreduce([t])
    third = wait_briefly(w, w.get_future(), 10)
    print(first is PENDING, second, t[0].item(), isinstance(third, str) and third != "", flush=True)
    os._exit(0)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_brief_wait_tells_running_done_and_failed_apart_and_leaves_a_running_work_intact(tmp_path):
    script = tmp_path / "brief.py"
    script.write_text(SCRIPT)
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    peer = subprocess.Popen([sys.executable, str(script), "1", port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        done = subprocess.run([sys.executable, str(script), "0", port], env=env, capture_output=True, text=True, timeout=120)
    finally:
        peer.kill()
        peer.wait()
    # still running after 20 ms (the peer sleeps), completed with the sum (1+1, then 2+2), the dead peer an error's text
    assert done.stdout.split() == ["True", "None", "4.0", "True"], done.stdout + done.stderr[-2000:]
