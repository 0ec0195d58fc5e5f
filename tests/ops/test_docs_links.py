"""The documentation a user clones is whole: every relative link of the README and docs/ resolves to a
file of the repository (and its #anchor to a heading there), and nothing points outside it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+\s+(.*)$", FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for doc in DOCS:
        for target in links(doc):
            if re.match(r"[a-z]+:", target):      # http(s), mailto: not ours to check offline
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.is_relative_to(ROOT) or not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_docs_name_nothing_outside_the_repository_and_no_issue_numbers():
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, doc
        assert not re.search(r"\bissue #?\d+", text, re.I), doc


TABLE = re.compile(r"^\|.*\|\n(?:\|.*\|\n?)*", re.M)           # a table: consecutive lines between pipes
CODE = re.compile(r"^```\S*\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"^(?:\.venv/bin/)?(?:tokenbus|python|bash) ", re.M)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_the_readme_is_a_guide_of_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_table_of_the_benchmarks_page_has_its_command_and_date_in_its_section():
    """A figure of docs/benchmarks.md sits below the command that produced it (a code block, or a
    cell naming it) and the date it was measured, both in its own section."""
    sections = re.split(r"^#+ .*$", (ROOT / "docs" / "benchmarks.md").read_text(), flags=re.M)
    tables, bare = 0, []
    for section in sections:
        for table in TABLE.finditer(section):
            tables += 1
            above = "\n".join(CODE.findall(section[:table.start()]))
            if not (COMMAND.search(above) or re.search(r"`(?:tokenbus|python) ", table[0])):
                bare.append(f"no command above: {table[0].splitlines()[0]}")
            if not DATE.search(section[:table.start()]):
                bare.append(f"no date above: {table[0].splitlines()[0]}")
    assert tables >= 10 and not bare, "\n".join(bare)


def test_the_readme_quotes_the_test_command_the_makefile_runs():
    """`make test`'s pytest line, as the README shows it (with --durations, so the slowest tests show)."""
    makefile = (ROOT / "Makefile").read_text()
    line = next(cmd.strip() for cmd in makefile.splitlines() if "-m pytest" in cmd)
    quoted = line.replace("$(BIN)", ".venv/bin").replace("$(VENV)", ".venv")
    assert "--durations" in quoted and f"`{quoted}`" in (ROOT / "README.md").read_text(), quoted


PATH_NAMED = re.compile(r"`([a-z_]+/[\w./]*)`")             # `workers/service/`, `schemas/messages.py`


def test_the_architecture_map_names_only_modules_that_exist_and_every_package():
    """docs/architecture.md's map of modules matches the tree: each path it names is there, and each
    package of ours (a folder with an __init__.py, tests aside) is named in it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = {p.rstrip("/") for p in PATH_NAMED.findall(text)}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    packages = {str(init.parent.relative_to(ROOT)) for init in ROOT.glob("*/**/__init__.py")
                if init.parts[len(ROOT.parts)] not in ("tests", ".venv") and ".egg-info" not in str(init)}
    unnamed = sorted(p for p in packages if p not in named)
    assert not unnamed, f"packages missing from docs/architecture.md's map: {unnamed}"
