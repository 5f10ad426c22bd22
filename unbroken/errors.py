"""The exceptions unbroken raises, one small hierarchy per part.

User mistakes are ``ValueError``/``TypeError`` subclasses so that ordinary code catches them;
failures of the machinery derive from :class:`UnbrokenError`.
"""

from __future__ import annotations


class UnbrokenError(Exception):
    """Base class of every failure that unbroken itself reports."""


class ConfigError(UnbrokenError, ValueError):
    """A setting or argument is invalid; the message says which and what to do."""


class CoordinatorUnreachable(UnbrokenError):
    """The coordinator did not answer within the configured timeout."""


class Unauthorized(CoordinatorUnreachable):
    """The coordinator refused a request for a missing or wrong token."""


class GenerationFailed(UnbrokenError):
    """A collective of the current generation failed or was abandoned; the step is redone."""


class JobCannotGoOn(UnbrokenError):
    """The coordinator says the job failed (too few members for longer than the quorum timeout,
    or every member gone): an outcome, not a bug, so a worker ends with this one line on stderr
    and exit status 1, without a traceback."""


JOB_CANNOT_GO_ON = "unbroken: the job cannot go on:"
"""How a worker's line for :class:`JobCannotGoOn` begins (a launcher does not repeat it)."""


class ReplicaDivergence(UnbrokenError):
    """Members hold different parameters after a commit: an invariant was broken."""


EXIT_MISMATCH = 78
"""Exit status of a worker the coordinator refused because it does not match the job (sysexits'
EX_CONFIG): its launcher stops that node instead of restarting it, since a restart would not match
any better."""


class LoopMisuse(UnbrokenError, RuntimeError):
    """The training loop broke a rule of :class:`~unbroken.Step` (backward not called once per
    micro-batch, gradients computed outside ``step.backward``): its gradients would be wrong or
    depend on the number of members, so the step is refused instead of applied."""


class SampleError(UnbrokenError, RuntimeError):
    """A sample of the data set could not be loaded (its ``__getitem__`` raised), or a
    micro-batch could not be collated. The message names the data set index, the sample's stream
    position and the step; the attributes hold them (``index`` and ``position`` are None when
    collating failed). Not retried: the same sample would fail again, and leaving it out would
    break exactly-once. The worker process ends with the error, like any exception in the script
    (see docs/guide/input-pipelines.md for the exit status)."""

    def __init__(self, message: str, step: int | None = None, index: int | None = None, position: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.index = index
        self.position = position


EXIT_RESTART_FRESH = 76
"""Exit status of a replica group's process whose group could not be brought to one state (its
processes hold different steps and nobody holds the job's state to heal them from): a restart
with a fresh state is the cure, never a bug in the script, so its launcher restarts it."""

EXIT_PEER_SILENT = 75
"""Exit status of a process whose group watchdog found a process of its group silent (sysexits'
EX_TEMPFAIL: a restart of the whole group is the cure). Distinct from a crash (1), a refusal
(:data:`EXIT_MISMATCH`, 78) and a worker whose parent died (3)."""

EXIT_STRAGGLER = 74
"""Exit status of a member that ``--stragglers evict`` ended for staying far slower than the
others: restarted and counted toward quarantine like a failure, never taken for the script's own error."""

RESTARTABLE_EXITS = frozenset({EXIT_PEER_SILENT, EXIT_RESTART_FRESH, EXIT_STRAGGLER})
"""Exits that ask for a restart: never counted as the script's own error."""


class LeaderCallFailed(UnbrokenError, RuntimeError):
    """The function that :meth:`~unbroken.Job.on_leader` ran on the leader raised (every other
    member raises this, naming the leader's error), or its result could not be shared."""
