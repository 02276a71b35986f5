"""The docs must not drift: docs/config.md is generated from the schema, and every relative link in
README.md and docs/*.md points at a file that exists and, with a #anchor, at one of its headings."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^()\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def test_config_reference_is_current():
    from reroll.config.schema import config_docs

    doc = ROOT / "docs" / "config.md"
    assert doc.read_text() == config_docs() + "\n", "regenerate: reroll config-docs > docs/config.md"


def _prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
    anchors: set[str] = set()
    for line in _prose_lines(path):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            anchor, n = base, 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return anchors


def test_relative_links_point_at_files_and_headings():
    # a hand-computed anchor: "## 5. Where a step's time goes" -> "5-where-a-steps-time-goes"
    assert "5-where-a-steps-time-goes" in _anchors(ROOT / "docs" / "real-model.md")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked, broken = 0, []
    for page in pages:
        for line in _prose_lines(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                checked += 1
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no heading with that anchor)")
    assert checked > 20, f"only {checked} links found: the pattern no longer reads the docs"
    assert not broken, "broken links:\n" + "\n".join(broken)
