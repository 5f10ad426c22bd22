"""The documentation: the site builds with no warnings, its CLI reference lists every flag, and the
README stays short with working links."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from unbroken.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BUILD_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built with ``mkdocs build --strict`` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _subcommand(name: str):
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices[name]


def _long_options(parser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def _sections(page: str) -> dict[str, str]:
    """The HTML of each ``h2`` section of a page, by its id."""
    parts = re.split(r'<h2 id="([^"]+)"', page)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_documentation_site_builds_with_no_warnings(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "reference" / "api" / "index.html").is_file()


@pytest.mark.parametrize("command", ["run", "coordinator"])
def test_every_long_option_of_a_command_is_in_its_section_of_the_cli_reference(site: Path, command: str) -> None:
    sections = _sections((site / "reference" / "cli" / "index.html").read_text())
    section = sections.get(f"unbroken-{command}")
    assert section is not None, f"no section for unbroken {command}; sections: {sorted(sections)}"
    options = _long_options(_subcommand(command))
    assert len(options) > 5
    missing = [o for o in options if f"<code>{o}</code>" not in section]
    assert not missing, f"options of unbroken {command} missing from the CLI reference: {missing}"


def test_the_api_reference_documents_the_public_names(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text()
    import unbroken

    for name in unbroken.__all__:
        if name != "__version__":
            assert f'id="unbroken.{name}"' in page, f"unbroken.{name} is not in the API reference"


def test_the_readme_is_at_most_150_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the detail into docs/"


def _relative_links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)  # links inside code are not links
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    targets += re.findall(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", text)
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_in_the_readme_points_at_an_existing_file() -> None:
    links = _relative_links(README.read_text())
    assert links, "the README links into docs/"
    broken = [t for t in links if not (ROOT / unquote(t.split("#")[0].split("?")[0])).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_the_readme_keeps_the_two_quickstart_commands() -> None:
    text = README.read_text()
    assert "pip install torch==2.13.0 -e '.[examples]' && unbroken run --nproc-per-node 4 examples/train_digits.py" in text
    assert "pip install torch==2.13.0 -e '.[test]' && python -m pytest" in text


DOC_PAGES = sorted((ROOT / "docs").rglob("*.md")) + [README]
API = (ROOT / "docs" / "reference" / "api.md").read_text()
DOCUMENTED = set(re.findall(r"^::: (\S+)$", API, re.M))
"""The dotted names the API reference documents (``::: module.Name``)."""


def _python_snippets(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _unbroken_imports(snippet: str) -> list[tuple[str, str]]:
    """(module, name) of each ``from unbroken... import`` in a snippet (``import unbroken``: the
    package itself)."""
    found = []
    for module, names in re.findall(r"^\s*from (unbroken[\w.]*) import ([^#\n]+)", snippet, re.M):
        for name in names.strip().strip("()").split(","):
            if name.strip():
                found.append((module, name.split(" as ")[0].strip()))
    return found


@pytest.mark.parametrize("path", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_snippet_imports_from_unbroken_exists_and_is_documented(path: Path) -> None:
    """The snippets of the docs import what exists, at its current path (no deprecated former
    path), and only what the API reference documents (the public names)."""
    import importlib
    import warnings

    for snippet in _python_snippets(path):
        for module, name in _unbroken_imports(snippet):
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                found = importlib.import_module(module)
            assert hasattr(found, name), f"{path.name}: `from {module} import {name}`: no such name"
            assert f"{module}.{name}" in DOCUMENTED, f"{path.name}: `from {module} import {name}` is not in the API reference"


def _settings_rows(command: str) -> list[tuple[str, str]]:
    """(flag, default cell) of each row of the settings page's table for ``unbroken COMMAND``."""
    page = (ROOT / "docs" / "guide" / "settings.md").read_text()
    section = re.split(r"^## ", page, flags=re.M)
    (text,) = [part for part in section if part.startswith(f"`unbroken {command}`")]
    return re.findall(r"^\| `(--[\w-]+)[^`]*` \| ([^|]*) \|", text, re.M)


@pytest.mark.parametrize("command", ["run", "coordinator"])
def test_every_flag_on_the_settings_page_exists_with_the_default_it_states(command: str) -> None:
    parser = _subcommand(command)
    actions = {s: a for a in parser._actions for s in a.option_strings}
    rows = _settings_rows(command)
    assert len(rows) > 10
    checked = 0
    for flag, cell in rows:
        assert flag in actions, f"settings.md names `{flag}` for unbroken {command}; the parser has no such flag"
        literal = re.fullmatch(r"`([^`]+)`", cell.strip())
        default = actions[flag].default
        if literal is None or default is None or isinstance(default, bool):
            continue  # a default said in words (none, the host name, ...)
        stated = literal.group(1)
        try:
            same = float(stated) == float(default)
        except (TypeError, ValueError):
            same = stated == str(default)
        assert same, f"settings.md says `{flag}` defaults to {stated}; the parser says {default!r}"
        checked += 1
    assert checked > 5
