"""Check the import contracts in pyproject.toml (``[tool.importlinter]``) with import-linter.

The top-level folders ``engine/``, ``telemetry/``, ``security/`` and ``console/`` install as
``vconsole.engine`` and so on (pyproject's ``package-dir`` mapping, read from there), but import-linter's graph builder walks one folder per
top-level package. So the sources are staged into a temporary tree laid out as installed
(``STAGE/vconsole/engine/...``) and import-linter runs there, with the same contracts.

    python scripts/lint_imports.py              # the repository as it is
    python scripts/lint_imports.py --root DIR   # another checkout (the tests plant bad imports)
    python scripts/lint_imports.py --contract engine-layers --verbose   # passed to lint-imports

Exit code: import-linter's (0 when every contract is kept, 1 when one is broken; its report
names the contract and the import chain).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = REPO) -> dict[str, str]:
    """Where each installed package's sources live (pyproject's package-dir mapping):
    ``{"vconsole/engine": "engine", ...}``."""
    with (root / "pyproject.toml").open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name.replace(".", "/"): folder for name, folder in mapping.items()}



def stage(root: Path, dest: Path) -> Path:
    """Copy the sources under ``root`` into ``dest/vconsole/...`` as they are installed."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "__snapshots__")
    for installed, source in package_dirs(root).items():
        shutil.copytree(root / source, dest / installed, ignore=ignore, dirs_exist_ok=True)
    return dest


def lint(root: Path = REPO, extra: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="vconsole-imports-") as tmp:
        staged = stage(root, Path(tmp))
        # The staged tree comes first on the path, ahead of the editable install's finder; a wide
        # COLUMNS keeps each contract's name on one line of the report.
        pythonpath = os.pathsep.join(filter(None, [str(staged), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": pythonpath, "COLUMNS": "200"}
        lint_imports = Path(sys.executable).with_name("lint-imports")
        cmd = [str(lint_imports) if lint_imports.exists() else "lint-imports",
               str(root / "pyproject.toml"), "--no-cache", "--no-logo", *extra]
        return subprocess.run(cmd, cwd=staged, env=env, capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="checkout to check")
    args, extra = parser.parse_known_args()
    result = lint(args.root.resolve(), extra)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
