"""Every relative link in the project's Markdown pages leads somewhere: to a file or folder in the
repository, and, with a `#anchor` into a Markdown file, to a heading of that file (GitHub's slugs).
Links to the web and mail addresses are not checked. Code blocks and inline code are skipped."""

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", REPO / "tests" / "README.md",
                *(REPO / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) or [text](target "title"); an image's ![alt](target) matches too
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")


def _prose(text: str) -> str:
    """The text with fenced code blocks and inline code blanked out (links in code are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, every character but letters, marks,
    digits, `_`, spaces and hyphens removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    kept = [c for c in text if c in " -" or unicodedata.category(c)[0] in "LNM"
            or unicodedata.category(c) == "Pc"]
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(_prose(page.read_text())):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(REPO) if REPO in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    return problems


def test_the_pages_exist():
    assert (REPO / "docs").is_dir() and len(PAGES) > 3


def test_the_readme_links_every_docs_page():
    """README.md is the front door: a page it does not link is a page nobody finds."""
    linked = {(REPO / target.partition("#")[0]).resolve() for target in LINK.findall((REPO / "README.md").read_text())
              if not target.startswith(EXTERNAL)}
    assert sorted(p.name for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slug_matches_github():
    assert slug("Off-policy corrections, KL, micro-batches") == "off-policy-corrections-kl-micro-batches"
    assert slug("pass@k and `rlmesh eval`") == "passk-and-rlmesh-eval"
    # an en dash is punctuation, so it goes
    assert slug("2026-11-24, 20:38–21:53 UTC: k=2 and k=0") == "2026-11-24-20382153-utc-k2-and-k0"
    assert slug("A multi-rank learner outside `rlmesh up`") == "a-multi-rank-learner-outside-rlmesh-up"
