"""The architecture holds: import contracts (import-linter, ``[tool.importlinter]`` in pyproject)
are kept, a planted bad import fails naming its contract, and the install is one package.

The contracts run through ``scripts/lint_imports.py``, which stages ``engine/``, ``telemetry/`` and
``console/`` as ``vconsole/engine/...`` (the package-dir mapping) before import-linter looks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = REPO / "scripts" / "lint_imports.py"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONTRACTS = {c["id"]: c["name"] for c in PYPROJECT["tool"]["importlinter"]["contracts"]}
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
SOURCE_ROOTS = tuple(PACKAGE_DIR.values())


def lint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(LINT), *args], capture_output=True, text=True,
                          timeout=120)


def copy_checkout(dest: Path) -> Path:
    """The parts of the checkout the contracts and the build read, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in SOURCE_ROOTS:
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: a child sees only what is installed in the environment."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# --- import contracts -------------------------------------------------------------------------

def test_contracts_have_ids_and_distinct_names():
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    assert len(CONTRACTS) == len(contracts) >= 8
    assert len(set(CONTRACTS.values())) == len(CONTRACTS)


def test_every_contract_is_kept_on_the_repository():
    result = lint()
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in out, f"{name!r} not reported kept:\n{out}"
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out


# (file to plant in, line appended, contract that must break, the import it must name)
PLANTED = [
    pytest.param("engine/sched/scheduler.py", "import vconsole.telemetry.publisher",
                 "telemetry-importers",
                 "vconsole.engine.sched.scheduler -> vconsole.telemetry.publisher",
                 id="sched-imports-telemetry"),
    pytest.param("engine/config.py", "import torch", "engine-data",
                 "vconsole.engine.config -> torch", id="config-imports-torch"),
    pytest.param("console/state.py", "from vconsole.engine.core import EngineCore", "console",
                 "vconsole.console.state -> vconsole.engine.core", id="console-imports-core"),
    pytest.param("engine/kv/block_pool.py", "from vconsole.engine.sched import scheduler",
                 "engine-layers", "vconsole.engine.kv.block_pool -> vconsole.engine.sched",
                 id="kv-imports-sched"),
    pytest.param("engine/worker/sampler.py", "from vconsole.engine.kv import block_pool",
                 "worker", "vconsole.engine.worker.sampler -> vconsole.engine.kv.block_pool",
                 id="worker-imports-kv"),
]


@pytest.mark.parametrize("path,line,contract,chain", PLANTED)
def test_a_planted_bad_import_breaks_its_contract_by_name(tmp_path, path, line, contract, chain):
    root = copy_checkout(tmp_path)
    with (root / path).open("a") as f:
        f.write(f"\n{line}  # planted by test_architecture\n")
    result = lint("--root", str(root))
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    name = CONTRACTS[contract]
    assert f"{name} BROKEN" in out, out
    assert chain in out, out


# --- packaging: one top-level package, vconsole ------------------------------------------------

def installed_name(folder: Path) -> str:
    """``engine/kv`` -> ``vconsole.engine.kv``, through the package-dir mapping."""
    rel = folder.relative_to(REPO).as_posix()
    for package, source in sorted(PACKAGE_DIR.items(), key=lambda kv: -len(kv[1])):
        if rel == source or rel.startswith(source + "/"):
            return ".".join([package, *Path(rel).relative_to(source).parts])
    raise AssertionError(f"{rel} is not under any package-dir source folder")


def source_folder(package: str) -> Path:
    for prefix, source in sorted(PACKAGE_DIR.items(), key=lambda kv: -len(kv[0])):
        if package == prefix or package.startswith(prefix + "."):
            return REPO / source / Path(*package[len(prefix):].split(".")[1:])
    raise AssertionError(f"{package} has no package-dir entry")


def test_every_source_package_is_listed_under_its_installed_name():
    listed = set(SETUPTOOLS["packages"])
    found = {installed_name(init.parent) for root in SOURCE_ROOTS
             for init in (REPO / root).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert found - listed == set(), "packages with an __init__.py missing from pyproject"
    assert listed - found == set(), "pyproject lists packages with no folder"
    for package in listed:
        assert package == "vconsole" or package.startswith("vconsole.")
        assert (source_folder(package) / "__init__.py").is_file(), package


def test_console_styles_are_package_data():
    assert (REPO / "console" / "app.tcss").is_file()
    assert "*.tcss" in SETUPTOOLS["package-data"]["vconsole.console"]


IMPORT_PROBE = """
import importlib, importlib.metadata, importlib.util, json, sys
result = {"top_level": importlib.metadata.distribution("vconsole").read_text("top_level.txt")}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        result[name] = "ok"
    except ModuleNotFoundError as e:
        result[name] = "ModuleNotFoundError: " + str(e)
print(json.dumps(result))
"""
OUTSIDE = ["engine", "telemetry", "security", "console", "support"]
INSIDE = ["vconsole", "vconsole.cli", "vconsole.commands", "vconsole.engine.core",
          "vconsole.engine.proc.core_proc", "vconsole.telemetry.publisher",
          "vconsole.security.curve",
          "vconsole.console.app"]


def test_outside_the_checkout_only_vconsole_is_importable(tmp_path):
    r = subprocess.run([sys.executable, "-c", IMPORT_PROBE, *OUTSIDE, *INSIDE], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got.pop("top_level").split() == ["vconsole"]
    for name in OUTSIDE:
        assert got[name].startswith("ModuleNotFoundError"), f"import {name} worked outside"
    for name in INSIDE:
        assert got[name] == "ok", f"import {name}: {got[name]}"


@pytest.mark.slow
def test_the_wheel_holds_only_the_vconsole_package(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed in this environment: no offline wheel build")
    src = copy_checkout(tmp_path / "src")
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(out), str(src)], env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("vconsole-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert len(dist_info) == 1
    (info,) = dist_info
    assert {n.split("/")[0] for n in names} == {"vconsole", info}
    top_level = zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode()
    assert top_level.split() == ["vconsole"]
    for expected in ("vconsole/cli.py", "vconsole/engine/core.py", "vconsole/engine/kv/__init__.py",
                     "vconsole/telemetry/publisher.py", "vconsole/console/app.py",
                     "vconsole/console/app.tcss"):
        assert expected in names, expected
