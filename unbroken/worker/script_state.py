"""State a script keeps beside the model (a best loss, a patience count, tokens seen), healed and
checkpointed with it.

A restarted or new worker is healed with the model, the optimizer, the scheduler and
``extra_state=``; a plain variable of the script starts over in it, and a decision taken on it
(early stopping) then differs from the others'. ``ScriptState`` is an attribute bag to pass as
``extra_state=``::

    progress = unbroken.ScriptState(best=float("inf"), bad=0)
    job = unbroken.Job(..., extra_state=progress)
    ...
    progress.bad += 1

Values must be plain data (numbers, strings, lists, dicts, tensors): they travel in heals and
checkpoints, which carry no code.
"""

from __future__ import annotations

from typing import Any


class ScriptState:
    """Named values healed and checkpointed with the model (pass it as ``Job(extra_state=...)``)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.clear()
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ScriptState({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"
