"""The map stays true: every package under ``vconsole/`` is drawn in docs/architecture.md's
layout tree, no product module grows past `MAX_LINES` unless ``[tool.vconsole.long-modules]``
in pyproject.toml names it with its one reason, and ``tests/`` mirrors ``vconsole/`` (each
package's tests in the folder of its path, no test in a folder that is no package's)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vconsole"
TESTS = REPO / "tests"
DOC = REPO / "docs" / "architecture.md"
# Folders of tests/ that mirror no package: shared builders, recordings and data, and
# pytest-textual-snapshot's SVGs (kept beside the test module that takes them).
NOT_MIRRORS = {"support", "data"}
SNAPSHOTS = "__snapshots__"
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


# --- tests/ mirrors vconsole/ ----------------------------------------------------------------

def modules(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]


def has_code(init: Path) -> bool:
    """Whether an ``__init__.py`` holds more than its docstring."""
    body = ast.parse(init.read_text()).body
    return len(body) > (1 if ast.get_docstring(ast.Module(body=body, type_ignores=[])) else 0)


def mirror_gaps(package: Path, tests: Path) -> tuple[list[str], list[str]]:
    """(the packages whose tests folder of the same path holds no ``test_*.py``, the tests
    folders holding one that match no package), as paths under ``package`` and ``tests``, the
    top package as ``""`` (its tests are tests/'s own). A folder whose only module is an
    ``__init__.py`` with nothing but a docstring (``entrypoints/``) groups packages: its tests
    folder may exist, and need not hold a test."""
    folders: set[str] = set()
    must_test: set[str] = set()
    for p in modules(package):
        folder = p.parent.relative_to(package).as_posix().removeprefix(".")
        folders.add(folder)
        if p.name != "__init__.py" or has_code(p):
            must_test.add(folder)
    tested = {p.parent.relative_to(tests).as_posix().removeprefix(".")
              for p in tests.rglob("test_*.py") if "__pycache__" not in p.parts}
    stray = {f for f in tested
             if f not in folders and f.split("/")[0] not in NOT_MIRRORS
             and SNAPSHOTS not in f.split("/")}
    return sorted(must_test - tested), sorted(stray)


def shown(folder: str, root: str) -> str:
    return f"{root}/{folder}/" if folder else f"{root}/"


def test_every_package_has_a_tests_folder_of_the_same_path_with_a_test():
    untested, _ = mirror_gaps(PACKAGE, TESTS)
    assert not untested, (
        "packages whose tests folder of the same path holds no test_*.py (move their tests "
        "there, or write one): "
        + ", ".join(f"{shown(f, 'vconsole')} -> {shown(f, 'tests')}" for f in untested))


def test_no_test_sits_in_a_folder_that_is_no_packages():
    _, stray = mirror_gaps(PACKAGE, TESTS)
    assert not stray, (
        "tests folders that match no package under vconsole/ (move each test to the folder of "
        "the package it tests): " + ", ".join(shown(f, "tests") for f in stray))


def test_the_mirror_rule_finds_a_package_without_tests_and_a_stray_folder(tmp_path):
    for name, text in {
            "pkg/__init__.py": "", "pkg/cli.py": "", "pkg/a/__init__.py": "", "pkg/a/x.py": "",
            "pkg/group/__init__.py": '"""Only a docstring."""\n', "pkg/group/b/x.py": "",
            "pkg/group/c/__init__.py": "from os import sep\n", "pkg/group/d/x.py": "",
            "tests/test_cli.py": "", "tests/a/test_x.py": "", "tests/group/c/test_c.py": "",
            "tests/group/d/conftest.py": "", "tests/old/test_y.py": "",
            "tests/support/test_like.py": "", "tests/data/test_gen.py": "",
            "tests/a/__snapshots__/test_x/test_shot.py": ""}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    untested, stray = mirror_gaps(tmp_path / "pkg", tmp_path / "tests")
    assert untested == ["group/b", "group/d"]       # not group/: a docstring only
    assert stray == ["old"]
    (tmp_path / "tests/test_cli.py").unlink()
    assert mirror_gaps(tmp_path / "pkg", tmp_path / "tests")[0][0] == ""     # the top package

