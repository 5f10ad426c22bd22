"""Which worker lines the console shows, and how: the log keeps every line as written.

The console follows one worker, plus the first and last lines of any worker's traceback and
unbroken's own errors. Collective libraries write long texts for a peer that died (Gloo: a
source location, the socket error, then "This is typically caused by a remote worker hanging or
bugs in the application ... GLHF!"), once per survivor and per kill: the console shows them cut
to what happened, and the worker's log keeps the raw text.
"""

from __future__ import annotations

import re

_ERROR_LINE = re.compile(r"^(Traceback \(most recent call last\)|([a-z_]\w*\.)*[A-Z]\w*(Error|Exception|Misuse|Failed|Divergence)\b|unbroken: error)")
_SOURCE_LOCATION = re.compile(r"\[(/[^\]\s]*|[\w.]+)\.(cc|cpp|cu|h|hpp):\d+\] ")
_BOILERPLATE = re.compile(r"\s*This is typically caused by a remote worker hanging or bugs in the application\..*$")


def looks_like_an_error(line: str) -> bool:
    """A line the console shows from any worker, whichever worker's output it follows: the first
    and the last line of a traceback, and unbroken's own errors."""
    return bool(_ERROR_LINE.match(line))


def for_console(line: str, log_name: str) -> str:
    """``line`` as the console shows it: without the collective library's source locations and
    boilerplate, with a pointer to ``log_name`` (which holds the raw text) when anything was cut.
    ``line`` ends with its newline, and so does the result."""
    text = line.rstrip("\n")
    short = _BOILERPLATE.sub("", _SOURCE_LOCATION.sub("", text))
    if short == text:
        return line
    return f"{short} (full text in {log_name})\n"
