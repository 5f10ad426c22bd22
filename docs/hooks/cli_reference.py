"""MkDocs hook: writes ``reference/cli.md`` from ``unbroken.cli.build_parser()`` at build time.

The page is never stored in the repository, so it cannot drift from the parser: a flag added to
the parser appears in the next build, with its help text and default. ``mkdocs.yml`` names this
file under ``hooks:``.
"""

from __future__ import annotations

import argparse
import html
import re

from mkdocs.structure.files import File, Files

PAGE = "reference/cli.md"

_INTRO = """\
# Command-line reference

This page is generated from the argparse parser (`unbroken.cli.build_parser()`) each time the
documentation is built, so it lists every flag the installed version takes. The
[settings](../guide/settings.md) page explains the flags and how they relate to each other.
Every `unbroken run` flag with a hyphen in its name also has a spelling with underscores, as
torchrun has (`--nproc-per-node` and `--nproc_per_node`).
"""


def _cell(text: str) -> str:
    """Text for a markdown table cell: no HTML, no emphasis, no column break."""
    text = html.escape(" ".join(text.split()), quote=False)
    return re.sub(r"([\\`*_|\[\]])", r"\\\1", text)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return parser._get_formatter()._expand_help(action)


def _default(action: argparse.Action) -> str:
    if action.required or not action.option_strings:
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if action.default is None:
        return "none"
    return f"`{action.default}`"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        return str(action.metavar)
    return action.dest.upper() if action.option_strings else action.dest


def _section(parser: argparse.ArgumentParser, title: str, summary: str | None, level: str) -> list[str]:
    lines = [f"{level} `{title}`", ""]
    if summary:
        lines += [_cell(summary[0].upper() + summary[1:].rstrip(".")) + ".", ""]
    usage = parser.format_usage().strip().removeprefix("usage: ")
    lines += ["```text", usage, "```", ""]
    positionals = [a for a in parser._actions if not a.option_strings]
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    subparsers = [a for a in positionals if isinstance(a, argparse._SubParsersAction)]
    positionals = [a for a in positionals if a not in subparsers]
    if positionals:
        lines += ["| argument | meaning |", "| --- | --- |"]
        for a in positionals:
            lines.append(f"| `{_value(a)}` | {_cell(_help(parser, a))} |")
        lines.append("")
    if options:
        lines += ["| option | value | default | meaning |", "| --- | --- | --- | --- |"]
        for a in options:
            names = "<br>".join(f"`{s}`" for s in a.option_strings)
            value = f"`{_value(a)}`" if _value(a) else ""
            lines.append(f"| {names} | {value} | {_default(a)} | {_cell(_help(parser, a))} |")
        lines.append("")
    return lines


def render(parser: argparse.ArgumentParser) -> str:
    """The whole page for ``parser`` (the ``unbroken`` parser) and each of its subcommands."""
    lines = [_INTRO]
    lines += _section(parser, parser.prog, parser.description, "##")
    for group in parser._subparsers._group_actions if parser._subparsers else []:
        summaries = {c.dest: c.help for c in group._choices_actions}
        for name, sub in group.choices.items():
            lines += _section(sub, f"{parser.prog} {name}", summaries.get(name), "##")
    return "\n".join(lines)


def on_files(files: Files, config) -> Files:
    from unbroken.cli import build_parser

    files.append(File.generated(config, PAGE, content=render(build_parser())))
    return files
