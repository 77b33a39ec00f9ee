"""The project's documentation holds together: the README's contents list names its sections, every link
between the README and docs/ reaches a file and a heading, and every citation of a docs page in the code
(``(docs/flink.md, "Result partitions")``) names a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A citation of a docs page by section, possibly wrapped over lines: docs/<page>.md, "A" (and "B").
CITATION = re.compile(r'docs/([\w-]+\.md),\s+("[^"]+"(?:\s+and\s+"[^"]+")*)')


def _headings(page: Path) -> list[str]:
    """The headings of a Markdown page, outside fenced code."""
    headings, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            headings.append(m.group(1).strip())
    return headings


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_readme_contents_name_every_section_and_nothing_else():
    readme = (ROOT / "README.md").read_text()
    contents = readme[readme.index("Contents:") : readme.index("\n\n", readme.index("Contents:"))]
    listed = re.findall(r"\]\(#([^)]+)\)", contents)
    level2 = [_anchor(m) for m in re.findall(r"^## (.+)$", re.sub(r"```.*?```", "", readme, flags=re.S), re.M)]
    # the sections after the contents list, but for "What it does", which follows the list directly
    after = level2[level2.index("quick-start") + 1 :]
    assert listed == [a for a in after if a != "what-it-does"], (listed, after)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_reaches_a_file_and_a_heading(page):
    for link in _links(page):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: link to {link}: no such file"
        if fragment and path.suffix == ".md":
            anchors = {_anchor(h) for h in _headings(path)}
            assert fragment in anchors, f"{page.name}: link to {link}: no such heading in {path.name}"


def test_every_citation_of_a_docs_page_names_one_of_its_headings():
    cited = 0
    for top in ("spark_credit_shuffle", "tests", "jobs"):
        for source in sorted((ROOT / top).rglob("*.py")):
            text = source.read_text()
            assert "\u00a7" not in text, (
                f"{source.relative_to(ROOT)} cites a section by number, not by file and heading"
            )
            for name, quoted in CITATION.findall(text):
                page = ROOT / "docs" / name
                assert page.exists(), f"{source.relative_to(ROOT)} cites docs/{name}, which does not exist"
                headings = {" ".join(h.split()) for h in _headings(page)}
                for heading in re.findall(r'"([^"]+)"', quoted):
                    heading = " ".join(heading.split())
                    assert heading in headings, f'{source.relative_to(ROOT)}: docs/{name} has no heading "{heading}"'
                    cited += 1
    assert cited >= 21  # the citations that once named sections of a document outside the repository
