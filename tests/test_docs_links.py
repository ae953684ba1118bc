"""Every relative link of README.md and docs/*.md resolves: the file exists and, with an anchor, the target holds a
heading with that GitHub slug (or an ``<a id>``); a link planted broken is found."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    seen, found = {}, set()
    for line in prose(path.read_text(encoding="utf-8")):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            base = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(base, 0)
            found.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
        found.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return found


def broken_links(files: list[Path]) -> list[str]:
    broken = []
    for source in files:
        for line in prose(source.read_text(encoding="utf-8")):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                path = (source.parent / file).resolve() if file else source
                if not path.exists():
                    broken.append(f"{source.name}: {target}: no such file")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    broken.append(f"{source.name}: {target}: no such anchor")
    return broken


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    assert broken_links([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "page.md").write_text("# Title\n[ok](#title) [gone](missing.md) [bad](#nowhere)\n")
    assert broken_links([tmp_path / "page.md"]) == ["page.md: missing.md: no such file",
                                                    "page.md: #nowhere: no such anchor"]
