"""The README and docs/ hold together: the README stays a short front door, every relative link (and its
``#anchor``) leads somewhere, every page of docs/ is in its index, and every path of this repository a page names
exists. Reads files only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_TOP = ("cp_infer/", "models/", "server/", "tests/", "docs/", ".ci/", "bench/")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _prose(page: Path) -> str:
    return _FENCE.sub("", page.read_text(encoding="utf-8"))


def test_slug_is_githubs():
    assert _slug("The mesh: replica groups, guidance ranks and Ulysses ranks") == \
        "the-mesh-replica-groups-guidance-ranks-and-ulysses-ranks"
    assert _slug("`bench/compile.py`: torch.compile of each transformer block") == \
        "benchcompilepy-torchcompile-of-each-transformer-block"
    assert _slug("`--compile`") == "--compile"


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the reference to docs/ (at most " \
                                      f"{README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading #{anchor}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_index_lists_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_named_exists(page):
    stale = []
    for span in _CODE_SPAN.findall(_prose(page)):
        for token in span.split():
            token = token.strip(".,;:()")
            if token.startswith(_TOP) and re.fullmatch(r"[\w./-]+", token) and not (REPO / token).exists():
                stale.append(token)
    assert not stale, f"{page.name} names paths that do not exist: {sorted(set(stale))}"
