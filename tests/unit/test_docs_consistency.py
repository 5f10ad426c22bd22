"""The documentation agrees with the code and with itself: every default a page gives for a flag
or a setting is the code's, every flag a page names exists, the run directory's table names every
file the launcher writes there, the API page names every public name, and a headline figure
quoted on several pages is the same on each. (tests/unit/test_docs.py checks the site's build,
the CLI reference and the settings tables of ``unbroken run`` and ``unbroken coordinator``.)"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from unbroken.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
NUMBER = r"(\d+(?:\.\d+)?)"


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _text(path: Path) -> str:
    return path.read_text()


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of the ``unbroken`` command, by subcommand (``""``: the top level)."""
    top = build_parser()
    found = {"": top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _flag_defaults() -> dict[str, list[object]]:
    """Each option string of any subcommand, with the defaults it has (one per subcommand)."""
    defaults: dict[str, list[object]] = {}
    for parser in _parsers().values():
        for action in parser._actions:
            for option in action.option_strings:
                defaults.setdefault(option, []).append(action.default)
    return defaults


def _settings_defaults() -> dict[str, list[object]]:
    """Each field of the settings dataclasses, with its defaults (a name may be in several)."""
    from unbroken.coordinator.membership import MembershipSettings
    from unbroken.coordinator.replicated import LeadershipSettings
    from unbroken.coordinator.settings import CoordinatorSettings
    from unbroken.launch.launch_settings import LaunchSettings
    from unbroken.storage.checkpoint_settings import CheckpointSettings
    from unbroken.worker.runtime_settings import RuntimeSettings

    defaults: dict[str, list[object]] = {}
    for cls in (RuntimeSettings, CheckpointSettings, LaunchSettings, MembershipSettings, CoordinatorSettings,
                LeadershipSettings):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                defaults.setdefault(f.name, []).append(f.default)
    return defaults


def _number(value: object) -> float | None:
    """A default as a number (argparse converts a string default with the flag's type), else None."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _same_number(stated: str, defaults: list[object]) -> bool:
    return any(_number(d) == float(stated) for d in defaults)


# --- defaults stated in prose -------------------------------------------------------------------

FLAG_DEFAULT = re.compile(
    r"`(--[a-z][\w-]*)(?: [A-Z][\w|:,.\[\]]*)?`"  # `--flag` or `--flag S`
    r"(?: (?:seconds|times|s))?"  # `--restart-window` seconds (default 300)
    r" \((?:default:? )?" + NUMBER + r"(?: ?(s|ms))?(?: by default)?[);,]"
)
"""``--flag`` followed by its default in parentheses: ``(20 s)``, ``(default 5)``, ``(3 s by
default)``, ``seconds (10)``. A parenthesis that holds a number with no unit and no "default"
("(2 nodes × 4 workers)") does not match, for want of the closing bracket right after it."""

FIELD_DEFAULT = re.compile(
    r"`([a-z][a-z_]*[a-z])`(?: \(`UNBROKEN_[A-Z_]+`,| more| \(`--[a-z-]+`,)? \(?default:? " + NUMBER + r"(?: ?(s|ms))?[);,]"
)
"""A settings field's default, as the protocol states them: ``progress_timeout`` (default 20 s),
``lease`` (``UNBROKEN_LEASE``, default 2.5 s), ``coordinator_grace`` more (default 10 s)."""

SECONDS_FIELD = re.compile(NUMBER + r" (s|ms) \(`([a-z][a-z_]*[a-z])`\)")
"""A fixed setting given as ``2 s (`hold`)``."""

ENV_DEFAULT = re.compile(r"`(UNBROKEN_[A-Z_]+)` \((?:default:? )?" + NUMBER + r"(?: ?(s|ms))?[);,]")
"""An environment variable's default: ``UNBROKEN_CHECKPOINT_MTBF`` (default 3600 s)."""

ENV_FIELDS = {
    "UNBROKEN_CHECKPOINT_MTBF": "mtbf",
    "UNBROKEN_CHECKPOINT_MAX_INTERVAL": "max_interval",
    "UNBROKEN_CHECKPOINT_KEEP": "keep",
    "UNBROKEN_CHECKPOINT_PART_TIMEOUT": "part_timeout",
}
"""The checkpoint variables, whose field is not the variable's name less ``UNBROKEN_``."""

ENV_CONSTANTS = {
    "UNBROKEN_CATCH_UP_STEPS": ("unbroken.worker.catch_up", "MAX_RECORDS"),
    "UNBROKEN_COORDINATOR_PORT": ("unbroken.launch.slurm", "DEFAULT_PORT"),  # under SLURM
}
"""Variables read by a module rather than a settings class: the module's constant."""


def _stated(pattern: re.Pattern[str]) -> list[tuple[str, re.Match[str]]]:
    return [(_name(page), m) for page in PAGES for m in pattern.finditer(_text(page))]


def _in_seconds(value: str, unit: str | None) -> str:
    return str(float(value) / 1000) if unit == "ms" else value


def test_every_default_a_page_gives_a_flag_is_the_parsers() -> None:
    flags = _flag_defaults()
    checked, wrong = 0, []
    for page, m in _stated(FLAG_DEFAULT):
        flag, value, unit = m.group(1), m.group(2), m.group(3)
        if flag not in flags:
            continue  # another program's flag (a benchmark script, etcd): test_every_flag_... below
        checked += 1
        if not _same_number(_in_seconds(value, unit), flags[flag]):
            wrong.append(f"{page}: {m.group(0)!r}, but the parser's default of {flag} is {flags[flag]}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 20, f"only {checked} flag defaults found in the docs: is FLAG_DEFAULT still matching?"


def test_every_default_a_page_gives_a_setting_is_the_dataclasss() -> None:
    import importlib

    settings = _settings_defaults()
    checked, wrong = 0, []
    for pattern, groups in ((FIELD_DEFAULT, (1, 2, 3)), (SECONDS_FIELD, (3, 1, 2))):
        for page, m in _stated(pattern):
            name, value, unit = (m.group(i) for i in groups)
            if name not in settings:
                continue
            checked += 1
            if not _same_number(_in_seconds(value, unit), settings[name]):
                wrong.append(f"{page}: {m.group(0)!r}, but the default of {name} is {settings[name]}")
    for page, m in _stated(ENV_DEFAULT):
        variable, value, unit = m.group(1), m.group(2), m.group(3)
        if variable in ENV_CONSTANTS:
            module, constant = ENV_CONSTANTS[variable]
            defaults = [getattr(importlib.import_module(module), constant)]
        else:
            field = ENV_FIELDS.get(variable, variable.removeprefix("UNBROKEN_").lower())
            defaults = settings.get(field)
            assert defaults is not None, f"{page}: {m.group(0)!r} names a variable that no setting reads"
        checked += 1
        if not _same_number(_in_seconds(value, unit), defaults):
            wrong.append(f"{page}: {m.group(0)!r}, but the code's default is {defaults}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 15, f"only {checked} setting defaults found in the docs: are the patterns still matching?"


def _table_rows(page: Path, heading: str) -> list[list[str]]:
    """The cells of each row of the first table under ``## heading`` (its header row excluded)."""
    sections = re.split(r"^## ", _text(page), flags=re.M)
    (section,) = [s for s in sections if s.startswith(heading)]
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*-", line):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
    return rows[1:]


def _literal(cell: str) -> str | None:
    m = re.match(r"^`([^`]+)`", cell)
    return m.group(1) if m else None


@pytest.mark.parametrize("cls_path", ["unbroken.worker.runtime_settings.RuntimeSettings",
                                      "unbroken.storage.checkpoint_settings.CheckpointSettings"])
def test_the_settings_tables_of_the_worker_list_every_field_with_its_variable_and_default(cls_path: str) -> None:
    import importlib

    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    page = DOCS / "guide" / "settings.md"
    rows: dict[str, list[tuple[str, str]]] = {}
    for line in _text(page).splitlines():
        m = re.match(r"^\| `(\w+)` \| `(UNBROKEN_\w+)` \| ([^|]*) \|", line)
        if m:
            rows.setdefault(m.group(1), []).append((m.group(2), m.group(3).strip()))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = "UNBROKEN_CHECKPOINT_" if name == "CheckpointSettings" else "UNBROKEN_"
    for field in fields.values():
        assert field.name in rows, f"settings.md has no row for {name}.{field.name}"
        variables = [v for v, _ in rows[field.name] if v.startswith(prefix)]
        expected = prefix + ("DIR" if field.name == "directory" else field.name.upper())
        assert expected in variables, f"settings.md gives {name}.{field.name} the variable {variables}, not {expected}"
        (cell,) = [c for v, c in rows[field.name] if v == expected]
        stated = _literal(cell)
        if stated is None or "<" in stated:
            continue  # said in words, or a pattern (`<host name>-<pid>`)
        default = field.default
        if default is None or isinstance(default, (bool, str)):
            assert stated.strip('"') == str(default), f"settings.md: {name}.{field.name} defaults to {stated}; the code says {default!r}"
        else:
            assert float(stated) == float(default), f"settings.md: {name}.{field.name} defaults to {stated}; the code says {default!r}"


@pytest.mark.parametrize("command", ["status", "demo"])
def test_the_settings_tables_of_the_small_commands_state_the_parsers_defaults(command: str) -> None:
    parser = _parsers()[command]
    actions = {s: a for a in parser._actions for s in a.option_strings}
    rows = _table_rows(DOCS / "guide" / "settings.md", f"`unbroken {command}`")
    assert rows
    from unbroken.launch import demo

    said_elsewhere = {("demo", "--steps"): demo.STEPS}  # default None: the demo's own constant
    for cells in rows:
        flag = re.match(r"`(--[\w-]+)", cells[0])
        if flag is None:
            continue  # the positional argument
        flag = flag.group(1)
        assert flag in actions, f"settings.md names `{flag}` for unbroken {command}; the parser has no such flag"
        stated = _literal(cells[1])
        default = said_elsewhere.get((command, flag), actions[flag].default)
        if stated is None or stated.startswith("$") or default is None or isinstance(default, bool):
            continue
        assert float(stated) == float(default), f"settings.md: unbroken {command} {flag} defaults to {stated}; the parser says {default}"


# --- flags named anywhere ----------------------------------------------------------------------

OTHER_PROGRAMS = {
    "--initial-cluster", "--election-timeout",  # etcd's own flags (Kubernetes and etcd pages)
    "--no-kill",  # srun's
    "--ulimit",  # docker's
}
"""Flags of programs that are neither unbroken nor a script of this repository."""


def _repository_flags() -> set[str]:
    """Every ``--flag`` string literal of the benchmark scripts, examples and tests: a page may
    name their flags (``bench_compare.py --repeats``)."""
    found: set[str] = set()
    for folder in ("benchmarks", "examples", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            found.update(re.findall(r"""["'](--[a-z][\w-]*)""", path.read_text(errors="replace")))
    return found


def test_every_flag_a_page_names_exists() -> None:
    known = set(_flag_defaults()) | _repository_flags() | OTHER_PROGRAMS
    unknown = sorted({f"{_name(page)}: {flag}" for page in PAGES
                      for flag in re.findall(r"`(--[a-z][\w-]*[a-z0-9])(?![\w*-])", _text(page)) if flag not in known})
    assert not unknown, "flags named in the docs that no parser or script has:\n" + "\n".join(unknown)


def test_every_flag_of_unbroken_run_is_named_on_the_settings_page() -> None:
    text = _text(DOCS / "guide" / "settings.md")
    run = _parsers()["run"]
    missing = [a.option_strings[-1] if a.option_strings[0].startswith("-") and not a.option_strings[0].startswith("--")
               else a.option_strings[0] for a in run._actions
               if a.option_strings and a.help is not argparse.SUPPRESS and a.dest != "help"
               and not any(f"`{o}" in text for o in a.option_strings)]
    assert not missing, f"flags of unbroken run that settings.md never names: {missing}"


# --- the run directory and the public names ---------------------------------------------------------

def test_the_run_directory_table_names_every_file_the_code_writes_there() -> None:
    written = set()
    for path in (ROOT / "unbroken").rglob("*.py"):
        if path.name == "demo.py":
            continue  # the demo's one-line runner, only when the package has no examples beside it
        written.update(re.findall(r'os\.path\.join\([\w.]*run_dir, "([^"/]+)', path.read_text()))
    assert {"launcher.json", "coordinator.json", "events.jsonl"} <= written, written
    rows = _table_rows(DOCS / "guide" / "launcher.md", "The run directory")
    listed = {re.match(r"`([^`/]+)", cells[0]).group(1) for cells in rows}
    assert not written - listed, f"the run directory table of launcher.md omits {sorted(written - listed)}"


def test_the_api_page_names_every_public_name_in_its_introduction() -> None:
    import unbroken

    intro = _text(DOCS / "reference" / "api.md").split("\n## ", 1)[0]
    missing = [n for n in unbroken.__all__ if f"`unbroken.{n}`" not in intro]
    assert not missing, f"the introduction of reference/api.md does not name {missing}"


def test_every_flag_help_that_names_busy_work_names_every_kind_of_it() -> None:
    """The busy marks the code sets (``.busy("...")``), against what --busy-timeout's help says."""
    marks = set()
    for path in (ROOT / "unbroken").rglob("*.py"):
        marks.update(re.findall(r'busy\(f?"([^"{]+)', path.read_text()))
    assert {"checkpoint snapshot", "checkpoint write", "reading a checkpoint"} <= marks, marks
    words = {"checkpoint snapshot": "snapshot", "checkpoint write": "write", "reading a checkpoint": "read",
             "running ": "on_leader", "warming the state's memory for the heal": "heal",
             "leaving the training loop": "leaving the loop"}
    unknown = marks - set(words)
    assert not unknown, f"busy marks this test does not know: {unknown}; add them to `words` and the help"
    for command in ("run", "coordinator"):
        (action,) = [a for a in _parsers()[command]._actions if "--busy-timeout" in a.option_strings]
        missing = [mark for mark in marks if words[mark] not in action.help]
        assert not missing, f"unbroken {command} --busy-timeout's help omits the busy marks {missing}"


# --- headline figures quoted on several pages -------------------------------------------------------

def _one(page: str, pattern: str) -> tuple[str, ...]:
    text = _text(ROOT / page)
    found = {m.groups() for m in re.finditer(pattern, text, re.M)}
    assert found, f"{page}: no match for {pattern!r}: the figure moved; update FIGURES"
    assert len(found) == 1, f"{page} quotes different values for one figure: {sorted(found)}"
    return found.pop()


RESULTS = "docs/benchmarks/results.md"
FOUR_MORE = r"\|(?:[^|\n]*\|){4}[ \t]*$"
"""The rest of a row of the five-system comparison table (not the two-system Ray Train table)."""
FIGURES = {
    "healthy step / plain DDP (ratio and range)": [
        (RESULTS, r"\| healthy step / plain DDP \| (\d\.\d\d) x \((\d\.\d\d)–(\d\.\d\d)\)"),
        (RESULTS, r"A healthy step is \d+ % slower than plain DDP\*\* \((\d\.\d\d)x, (\d\.\d\d)–(\d\.\d\d)\)"),
        ("README.md", r"\| healthy step / plain DDP \| (\d\.\d\d) x \((\d\.\d\d)–(\d\.\d\d)\)"),
        ("docs/limits.md", r"slower than plain DDP\*\* \((\d\.\d\d)x, (\d\.\d\d)–(\d\.\d\d)\)"),
    ],
    "healthy step / plain DDP (ratio)": [
        (RESULTS, r"\| healthy step / plain DDP \| (\d\.\d\d) x[^|\n]*" + FOUR_MORE),
        ("docs/benchmarks/goodput.md", r"\((\d\.\d\d)x plain DDP\s+on a 6 ms step"),
    ],
    "healthy step overhead in percent": [
        (RESULTS, r"A healthy step is (\d+) ?% slower than plain DDP"),
        ("docs/limits.md", r"A healthy step is (\d+) ?% slower than plain DDP"),
    ],
    "healthy step on the 20 ms model": [
        (RESULTS, r"\(a 20 ms step\) unbroken measured (\d\.\d\d)x"),
        ("docs/limits.md", r"(\d\.\d\d)x on a 20 ms step"),
        ("docs/benchmarks/goodput.md", r"(\d\.\d\d)x on a 20 ms one"),
    ],
    "chaos goodput": [
        (RESULTS, r"\| chaos: goodput / healthy plain DDP \| ([\d.]+ % \([\d.–]+\)) " + FOUR_MORE),
        ("README.md", r"\| chaos: goodput / healthy plain DDP \| ([\d.]+ % \([\d.–]+\))"),
    ],
    "rejoin: restart to first commit": [
        (RESULTS, r"\| rejoin: restart to first commit \| ([\d.]+ s \([\d.–]+\))"),
        ("README.md", r"\| rejoin: restart to first commit \| ([\d.]+ s \([\d.–]+\))"),
        ("docs/guide/launcher.md", r"a killed worker's restart to its first commit took ([\d.]+ s \([\d.–]+\))\s+forked"),
    ],
    "heal over two connections, times a warm broadcast": [
        (RESULTS, r"two connections \(unbroken's path\) \| [^|]+ \| \*\*(0\.\d\d)\*\* \| [^|]+ \| \*\*(0\.\d\d)\*\*"),
        ("docs/guide/healing.md", r"two connections healed 1\.2 GB in (0\.\d\d)-(0\.\d\d)x the time of a"),
        ("docs/benchmarks/goodput.md", r"a warmed heal over two connections in (0\.\d\d)-(0\.\d\d)x the time"),
    ],
    "throughput with one member at half speed (stragglers)": [
        ("README.md", r"(0\.\d\d) of the ideal throughput with one member at\s+half speed, against (0\.\d\d) for DDP"),
        ("docs/benchmarks.md", r"kept (0\.\d\d) of the ideal throughput \([^)]*\), DDP (0\.\d\d)"),
    ],
}
"""Each figure, and where each page quotes it: a pattern whose groups are the figure. Every page's
groups must be equal."""


@pytest.mark.parametrize("figure", sorted(FIGURES))
def test_a_figure_quoted_on_several_pages_is_the_same_on_each(figure: str) -> None:
    quoted = [(page, _one(page, pattern)) for page, pattern in FIGURES[figure]]
    values = {groups for _, groups in quoted}
    assert len(values) == 1, f"{figure}: the pages disagree: " + "; ".join(f"{p}: {g}" for p, g in quoted)


def test_the_overhead_in_percent_is_the_ratio() -> None:
    (ratio, _, _) = _one(RESULTS, r"\| healthy step / plain DDP \| (\d\.\d\d) x \((\d\.\d\d)–(\d\.\d\d)\)")
    for page in (RESULTS, "docs/limits.md"):
        (percent,) = _one(page, r"A healthy step is (\d+) ?% slower than plain DDP")
        assert int(percent) == round((float(ratio) - 1) * 100), f"{page}: {percent} % slower, but the ratio is {ratio}"


def test_the_readme_comparison_table_is_the_results_pages() -> None:
    def table(page: str) -> list[str]:
        text = _text(ROOT / page)
        start = text.index("| | unbroken | plain DDP (torchrun) |")
        return [line for line in text[start:].splitlines()[:30] if line.startswith("|")][:20]

    readme, results = table("README.md"), table(RESULTS)
    assert readme == results, "README.md's comparison table differs from docs/benchmarks/results.md's"
