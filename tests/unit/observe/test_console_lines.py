"""What the console shows of a worker's lines (the log keeps them as written)."""

from unbroken.observe.console_lines import for_console, looks_like_an_error

GLOO = (
    "vm.w1.r0: generation 1 failed: step 6 not sent: the script's barrier failed: "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:29595: Connection reset"
    " by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs of the remote"
    " worker before reporting an error. GLHF! \U0001f3d6\ufe0f\n"
)


def test_a_gloo_error_is_cut_to_what_happened_and_points_at_the_log():
    shown = for_console(GLOO, "workers/w1.log")
    assert shown == (
        "vm.w1.r0: generation 1 failed: step 6 not sent: the script's barrier failed: Read error [127.0.0.1]:29595:"
        " Connection reset by peer. (full text in workers/w1.log)\n"
    )


def test_other_lines_are_shown_as_written():
    for line in ("step 3 loss 0.5 members 2\n", "see [note] at x.cc\n", "Traceback (most recent call last):\n"):
        assert for_console(line, "workers/w0.log") == line


def test_tracebacks_and_unbrokens_errors_reach_the_console_from_any_worker():
    assert looks_like_an_error("Traceback (most recent call last):\n")
    assert looks_like_an_error("torch.distributed.DistBackendError: boom\n")
    assert looks_like_an_error("unbroken.errors.LoopMisuse: call step.commit()\n")
    assert looks_like_an_error("unbroken: error: bad flag\n")
    assert not looks_like_an_error("step 3 loss 0.5\n")
