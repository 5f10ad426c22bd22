"""The marks by which a node's workers tell its launcher which of them leads (the console)."""

import os

from unbroken.observe import leader_mark


def test_the_newest_generation_that_a_worker_leads_names_the_leader(tmp_path):
    run_dir = str(tmp_path)
    os.makedirs(tmp_path / "workers")
    assert leader_mark.newest_leader(run_dir, ["a", "b", "c"]) is None  # nothing formed yet
    leader_mark.write(run_dir, "a", 1, 0)
    leader_mark.write(run_dir, "b", 1, 1)
    assert leader_mark.newest_leader(run_dir, ["a", "b", "c"]) == (1, "a")
    leader_mark.write(run_dir, "b", 2, 0)  # a dies unseen: b leads generation 2, a's mark is older
    assert leader_mark.newest_leader(run_dir, ["a", "b", "c"]) == (2, "b")
    leader_mark.write(run_dir, "b", 3, 1)  # generation 3 is led from another node
    assert leader_mark.newest_leader(run_dir, ["a", "b", "c"]) == (1, "a")  # older: the coordinator's answer wins
    assert leader_mark.newest_leader(run_dir, ["b", "c"]) is None  # only the node's current members count


def test_a_run_without_a_writable_run_directory_marks_nothing(tmp_path):
    leader_mark.write(None, "a", 1, 0)
    leader_mark.write(str(tmp_path / "missing"), "a", 1, 0)  # no error: the console falls back on polling
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "a.rank").write_text("garbage")
    assert leader_mark.newest_leader(str(tmp_path), ["a"]) is None
