"""The docs match the tree: docs/design.md §2.1 lists every module, and relative links resolve."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SOURCE_ROOTS = ("fly_llm", "daemon", "integrations", "benchmarks", "examples")
SKIPPED_PARTS = {"__pycache__", "results", "build"}
CONTINUATION_INDENT = 16  # deeper lines continue the description above them
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def section(text: str, start: str, end: str) -> str:
    """The text from the heading `start` to the heading `end`."""
    begin = text.index(start)
    return text[begin : text.index(end, begin)]


def layout_block(text: str) -> str:
    """The first fenced block of docs/design.md §2.1."""
    match = FENCE.search(section(text, "### 2.1 ", "### 2.2 "))
    assert match, "docs/design.md §2.1 has no fenced layout block"
    return match.group(0)


def listed_paths(block: str) -> set[str]:
    """Paths the layout tree names: an entry is the first word of a line, nested by indentation."""
    parents: list[tuple[int, str]] = []
    paths: set[str] = set()
    for line in block.splitlines()[1:-1]:
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= CONTINUATION_INDENT:
            continue
        name = line.split()[0]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = (parents[-1][1] if parents else "") + name
        paths.add(path.rstrip("/"))
        if name.endswith("/"):
            parents.append((indent, path))
    return paths


def modules_in_tree() -> set[str]:
    """Every Python module under the source roots; a package's `__init__.py` is its directory."""
    found: set[str] = set()
    for source_root in SOURCE_ROOTS:
        for path in (ROOT / source_root).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if SKIPPED_PARTS.intersection(relative.parts) or any(p.startswith(".") for p in relative.parts):
                continue
            found.add(str(relative.parent if path.name == "__init__.py" else relative))
    return found


def test_layout_lists_every_module() -> None:
    listed = listed_paths(layout_block(DESIGN.read_text()))
    missing = sorted(modules_in_tree() - listed)
    assert not missing, f"docs/design.md §2.1 does not list: {missing}"


def test_layout_lists_every_test_area() -> None:
    listed = listed_paths(layout_block(DESIGN.read_text()))
    areas = {f"tests/{p.name}" for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert not sorted(areas - listed), f"docs/design.md §2.1 does not list: {sorted(areas - listed)}"


def test_layout_lists_only_what_exists() -> None:
    gone = sorted(p for p in listed_paths(layout_block(DESIGN.read_text())) if not (ROOT / p).exists())
    assert not gone, f"docs/design.md §2.1 lists what is not in the tree: {gone}"


def test_listed_paths_nest_by_indentation() -> None:
    block = "```text\na/       x\n  b.py   y\n                 more of y\n  c/     z\n    d.py w\ne.py     v\n```"
    assert listed_paths(block) == {"a", "a/b.py", "a/c", "a/c/d.py", "e.py"}


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings (repeats get -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in FENCE.sub("", markdown).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            result.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return result


def documents() -> list[Path]:
    """The Markdown a reader follows links in: the README, docs/, examples/ and the results' READMEs."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").glob("*.md")),
        *sorted((ROOT / "benchmarks" / "results").glob("*/README.md")),
    ]


def test_slug_follows_github() -> None:
    assert slug("HTTP front (OpenAI-compatible)") == "http-front-openai-compatible"
    assert slug("Quality with confidence intervals (`--quality`)") == "quality-with-confidence-intervals---quality"


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    text = INLINE_CODE.sub("", FENCE.sub("", document.read_text()))
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)}: links that lead nowhere: {broken}"
