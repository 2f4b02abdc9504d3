"""The map stays true: every package under ``vconsole/`` is drawn in docs/architecture.md's
layout tree, and no product module grows past `MAX_LINES` unless ``[tool.vconsole.long-modules]``
in pyproject.toml names it with its one reason."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vconsole"
DOC = REPO / "docs" / "architecture.md"
MAX_LINES = 500
TREE_INDENT_MAX = 8          # deeper lines of the tree block are descriptions, not entries


def packages() -> set[str]:
    """Every folder under vconsole/ that holds Python modules, as ``engine/dp/ray``."""
    return {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts and p.parent != PACKAGE}


def drawn_folders(text: str) -> set[str]:
    """The folders the layout tree draws: ``vconsole/`` at the left, each level two spaces in,
    an entry's first word ending in ``/`` (``entrypoints/openai/`` names two levels)."""
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    found: set[str] = set()
    for line in block.splitlines():
        words = line.split()
        if not words or not words[0].endswith("/"):
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent > TREE_INDENT_MAX:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([p for _, p in stack] + [words[0].rstrip("/")])
        stack.append((indent, path.rsplit("/", 1)[-1] if stack else path))
        if path.startswith("vconsole/"):
            found.add(path.removeprefix("vconsole/"))
            for i in range(1, path.count("/") + 1):      # a two-level entry names its parent
                found.add("/".join(path.split("/")[1:i + 1]))
    return found


def test_every_package_is_drawn_in_the_architecture_map():
    missing = sorted(packages() - drawn_folders(DOC.read_text()))
    assert not missing, f"docs/architecture.md's layout does not draw: {missing}"


def test_the_map_draws_no_package_that_is_gone():
    gone = sorted(drawn_folders(DOC.read_text()) - packages())
    assert not gone, f"docs/architecture.md draws folders that hold no module: {gone}"


def test_the_map_reader_sees_nesting():
    tree = "## Layout\n```\nvconsole/\n  engine/\n    dp/\n      ray/   Ray\n" \
           "                  not/ a tree entry\n  entrypoints/openai/  HTTP\ntests/\n```\n"
    assert drawn_folders(tree) == {"engine", "engine/dp", "engine/dp/ray", "entrypoints",
                                   "entrypoints/openai"}


def long_modules_allowed() -> dict[str, str]:
    table = tomllib.loads((REPO / "pyproject.toml").read_text())
    return table.get("tool", {}).get("vconsole", {}).get("long-modules", {})


def test_no_product_module_is_longer_than_the_limit_without_its_reason():
    allowed = long_modules_allowed()
    long = {p.relative_to(REPO).as_posix(): n for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexplained = {p: n for p, n in long.items() if p not in allowed}
    assert not unexplained, (f"modules over {MAX_LINES} lines: split them by job, or name each "
                             f"in pyproject.toml's [tool.vconsole.long-modules] with its reason: "
                             f"{unexplained}")
    for path, reason in allowed.items():
        assert path in long, f"{path} is allowed to be long but is not: drop it from the list"
        assert re.search(r"\w{3,}.*\s.*\w", reason), f"{path}: say why in a sentence"
