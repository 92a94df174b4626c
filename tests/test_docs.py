"""The documentation stays true to the repository: generated references are current, the README
is short and links every page in docs/, every relative link resolves, and nothing tracked points
outside the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 260
LINKED_PAGES = [
    README,
    ROOT / "CHANGELOG.md",
    ROOT / "charts" / "README.md",
    ROOT / "crds" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
# Markdown links and images: [text](target) and ![alt](target), target without a title.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)[^`].*?\1", re.S)
# Spelled in pieces so that this file does not match its own check.
OUTSIDE = ("../" + "shared", "design" + ".md")


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / name for name in out.split("\0") if name]


def relative_links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http(s), mailto
        targets.append(page.name + target if target.startswith("#") else target)
    return targets


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_generated_references_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_reference.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, (
        "a generated reference (docs/*.md, the CRD's engine fields) is stale: run "
        "`python tools/gen_reference.py`\n" + proc.stdout[-6000:] + proc.stderr[-2000:]
    )


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_readme_links_every_docs_page() -> None:
    linked = {(README.parent / unquote(t.split("#")[0])).resolve() for t in relative_links(README)}
    pages = sorted(p for p in (ROOT / "docs").iterdir() if p.is_file())
    assert pages, "docs/ is empty"
    missing = [p.relative_to(ROOT).as_posix() for p in pages if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    assert page.is_file(), page
    broken = []
    for target in relative_links(page):
        file, _, anchor = unquote(target).partition("#")
        path = (page.parent / file).resolve()
        if not path.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_nothing_tracked_points_outside_the_repository() -> None:
    hits = []
    for path in tracked_files():
        if not path.is_file():
            continue  # deleted in the work tree, not yet committed
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for needle in OUTSIDE:
            for number, line in enumerate(text.splitlines(), 1):
                if needle in line:
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {needle}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)
