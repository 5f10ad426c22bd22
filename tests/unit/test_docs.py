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
    for name in ("Job", "Step", "RuntimeSettings", "RandomWindows", "ScriptState"):
        assert f'id="unbroken.{name}"' in page, f"unbroken.{name} is not in the API reference"


def test_the_readme_is_at_most_about_two_hundred_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move the detail into docs/"


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
