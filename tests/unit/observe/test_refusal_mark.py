"""The mark by which a refused member tells its launcher the status it was refused with."""

from unbroken.observe import refusal_mark


def test_a_refusal_is_read_back_for_its_member_only_and_cleared_before_a_start(tmp_path):
    (tmp_path / "workers").mkdir()
    run_dir = str(tmp_path)
    assert refusal_mark.read(run_dir, "b.w0.r0") is None
    refusal_mark.write(run_dir, "b.w0.r0", 78)
    assert refusal_mark.read(run_dir, "b.w0.r0") == 78
    assert refusal_mark.read(run_dir, "b.w0.r1") is None  # a restart is another member
    refusal_mark.clear(run_dir, "b.w0.r0")
    assert refusal_mark.read(run_dir, "b.w0.r0") is None


def test_without_a_writable_run_directory_nothing_is_marked(tmp_path):
    refusal_mark.write(None, "a", 78)
    refusal_mark.write(str(tmp_path / "missing"), "a", 78)
    assert refusal_mark.read(str(tmp_path / "missing"), "a") is None
