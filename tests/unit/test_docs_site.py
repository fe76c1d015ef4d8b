"""The manual as a site (issue 36): docs/ builds with MkDocs in strict mode, mkdocs.yml's nav
lists every page and only pages that exist, and README.md stays the front page that links
into it. Real files and a real ``mkdocs build``; about 3 s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 250  # the front page; the rest of the manual lives in docs/


def _nav_pages(node: object) -> list[str]:
    """Every page path named in an mkdocs ``nav`` (nested sections included)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    raise AssertionError(f"unexpected nav entry {node!r}")


def test_mkdocs_build_strict_succeeds(tmp_path):
    """`mkdocs build --strict` (warnings are errors: a broken link or anchor between pages, a
    page missing from nav) writes the site. The `test` extra pins mkdocs and the theme."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError as e:
        pytest.fail(f"{e}: install the test extra (pip install -e '.[test]'), which pins "
                    "mkdocs and mkdocs-material")
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                        str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (site / "index.html").is_file()
    assert (site / "troubleshooting" / "index.html").is_file()


def test_nav_lists_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config.get("docs_dir", "docs") == "docs"
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), "a page is listed twice in nav"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(set(nav) - pages) == [], "nav names pages that are not in docs/"
    assert sorted(pages - set(nav)) == [], "pages in docs/ that nav does not reach"
    assert nav[0] == "index.md"


def test_readme_is_the_front_page_and_its_links_into_docs_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, (
        "README.md is the front page: move the subject's text to its page in docs/")
    targets = re.findall(r"\]\((docs/[^)#]*)(?:#[^)]*)?\)", readme)
    assert targets, "README.md links to no docs page"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert missing == []
    linked = {t.removeprefix("docs/") for t in targets}
    not_linked = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
                        if p.relative_to(DOCS).as_posix() not in linked)
    assert not_linked == [], "README.md's list of pages misses these"


def test_docs_give_the_readme_commands_and_carry_no_ci_marker():
    """CI (`.ci/run`) reads the commands after README.md's `<!-- command: ... -->` markers; the
    docs pages give the same commands as written, and no marker of their own (README.md stays
    the one source CI runs)."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^<!-- command: [a-z-]+ -->\n```[a-z]*\n(.*)\n```", readme,
                          flags=re.MULTILINE)
    assert len(commands) == 3
    docs = {p.name: p.read_text() for p in DOCS.rglob("*.md")}
    assert [name for name, text in docs.items() if "<!-- command:" in text] == []
    demo, tests, slow = commands
    assert demo in docs["getting-started.md"] and tests in docs["getting-started.md"]
    assert slow in docs["tests.md"]
