"""The architecture holds: import contracts (import-linter, ``[tool.importlinter]`` in pyproject)
are kept, a planted bad import fails naming its contract, and the install is one package whose
folders are its import names (``vconsole/engine/`` is ``vconsole.engine``).

The contracts run as `make lint` runs them (``lint-imports``); a planted import goes into a copy
of the tree, which `lint_copy` puts first on the path (ahead of the editable install's finder).
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
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONTRACTS = {c["id"]: c["name"] for c in PYPROJECT["tool"]["importlinter"]["contracts"]}
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
WIDE = {**os.environ, "COLUMNS": "400"}     # one contract, one line: its name is found whole

# Runs import-linter on the tree at ROOT (argv[1]), not on the installed one: the editable
# install's import hook would otherwise answer `import vconsole` from the checkout.
LINT_COPY = """
import sys
root = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path_importer_cache.clear()
sys.path.insert(0, root)
import vconsole
assert vconsole.__file__.startswith(root), vconsole.__file__
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=root + "/pyproject.toml", no_cache=True, no_logo=True))
"""


def lint() -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the checkout, exactly as `make lint` runs it."""
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=REPO,
                          env=WIDE, capture_output=True, text=True, timeout=120)


def lint_copy(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", LINT_COPY, str(root)], cwd=root, env=WIDE,
                          capture_output=True, text=True, timeout=120)


def copy_checkout(dest: Path) -> Path:
    """The parts of the checkout the contracts and the build read, without caches."""
    shutil.copytree(REPO / "vconsole", dest / "vconsole",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
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
    pytest.param("engine/sched/scheduler.py", "import vconsole.telemetry.schema",
                 "telemetry-importers",
                 "vconsole.engine.sched.scheduler -> vconsole.telemetry.schema",
                 id="sched-imports-telemetry"),
    pytest.param("engine/sched/scheduler.py", "import vconsole.engine.publish.publisher",
                 "sched-kv",
                 "vconsole.engine.sched.scheduler -> vconsole.engine.publish.publisher",
                 id="sched-imports-publisher"),
    pytest.param("shared/config.py", "import torch", "shared",
                 "vconsole.shared.config -> torch", id="shared-config-imports-torch"),
    pytest.param("shared/stats.py", "from vconsole.engine import latency", "shared",
                 "vconsole.shared.stats -> vconsole.engine.latency", id="shared-imports-engine"),
    pytest.param("engine/request.py", "import zmq", "engine-data",
                 "vconsole.engine.request -> zmq", id="engine-data-imports-zmq"),
    pytest.param("telemetry/schema.py", "import vconsole.engine.core", "telemetry-no-engine",
                 "vconsole.telemetry.schema -> vconsole.engine.core",
                 id="telemetry-imports-engine"),
    pytest.param("wire/protocol.py", "import vconsole.engine.core", "wire",
                 "vconsole.wire.protocol -> vconsole.engine.core", id="wire-imports-engine"),
    pytest.param("wire/control.py", "from vconsole.telemetry import schema", "wire",
                 "vconsole.wire.control -> vconsole.telemetry.schema",
                 id="wire-imports-telemetry"),
    pytest.param("engine/process/core_proc.py", "from vconsole.engine.client import client",
                 "engine-layers", "vconsole.engine.process.core_proc -> vconsole.engine.client",
                 id="process-imports-client"),
    pytest.param("engine/process/input_thread.py", "from vconsole.engine.launch import child",
                 "engine-layers", "vconsole.engine.process.input_thread -> vconsole.engine.launch",
                 id="process-imports-launch"),
    pytest.param("engine/launch/supervisor.py", "import vconsole.tools.top", "engine-no-ui",
                 "vconsole.engine.launch.supervisor -> vconsole.tools.top",
                 id="engine-imports-tools"),
    pytest.param("engine/client/client.py", "from vconsole.engine.publish import publisher",
                 "engine-no-telemetry", "vconsole.engine.client.client -> vconsole.engine.publish",
                 id="client-imports-publisher"),
    pytest.param("entrypoints/openai/protocol.py", "from vconsole.engine.process import core_proc",
                 "entrypoints",
                 "vconsole.entrypoints.openai.protocol -> vconsole.engine.process.core_proc",
                 id="server-imports-engine-process"),
    pytest.param("telemetry/alerts.py", "import vconsole.tools.top", "telemetry",
                 "vconsole.telemetry.alerts -> vconsole.tools.top", id="telemetry-imports-tools"),
    pytest.param("security/endpoints.py", "import vconsole.entrypoints", "security",
                 "vconsole.security.endpoints -> vconsole.entrypoints",
                 id="security-imports-entrypoints"),
    pytest.param("engine/publish/publisher.py", "from vconsole.engine.process import core_proc",
                 "publish",
                 "vconsole.engine.publish.publisher -> vconsole.engine.process.core_proc",
                 id="publisher-imports-process"),
    pytest.param("engine/publish/queue_mirror.py",
                 "from vconsole.engine.sched import request_queue", "publish",
                 "vconsole.engine.publish.queue_mirror -> vconsole.engine.sched.request_queue",
                 id="queue-mirror-imports-the-queue"),
    pytest.param("whatif/simulate.py", "from vconsole.engine.publish import request_rows",
                 "whatif", "vconsole.whatif.simulate -> vconsole.engine.publish.request_rows",
                 id="whatif-imports-publishing"),
    pytest.param("console/state.py", "from vconsole.engine.core import EngineCore", "console",
                 "vconsole.console.state -> vconsole.engine.core", id="console-imports-core"),
    pytest.param("console/state.py", "from vconsole.engine.publish import publisher", "console",
                 "vconsole.console.state -> vconsole.engine.publish.publisher",
                 id="console-imports-publisher"),
    pytest.param("engine/kv/block_pool.py", "from vconsole.engine.sched import scheduler",
                 "engine-layers", "vconsole.engine.kv.block_pool -> vconsole.engine.sched",
                 id="kv-imports-sched"),
    pytest.param("engine/worker/sampler.py", "from vconsole.engine.kv import block_pool",
                 "worker", "vconsole.engine.worker.sampler -> vconsole.engine.kv.block_pool",
                 id="worker-imports-kv"),
    pytest.param("whatif/simulate.py", "import torch", "whatif",
                 "vconsole.whatif.simulate -> torch", id="whatif-imports-torch"),
    pytest.param("console/predictions.py", "from vconsole.engine.kv import block_pool",
                 "console", "vconsole.console.predictions -> vconsole.engine.kv.block_pool",
                 id="console-imports-kv-beside-whatif"),
    pytest.param("console/screens/overview.py",
                 "if TYPE_CHECKING: from vconsole.console.app import VConsoleApp", "console-host",
                 "vconsole.console.screens.overview -> vconsole.console.app",
                 id="screen-imports-the-app-for-types"),
    pytest.param("cli.py", "from vconsole.engine.worker import tiny_model", "cli",
                 "vconsole.cli -> vconsole.engine.worker.tiny_model", id="cli-imports-worker"),
]


@pytest.mark.parametrize("path,line,contract,chain", PLANTED)
def test_a_planted_bad_import_breaks_its_contract_by_name(tmp_path, path, line, contract, chain):
    root = copy_checkout(tmp_path)
    with (root / "vconsole" / path).open("a") as f:
        f.write(f"\n{line}  # planted by test_architecture\n")
    result = lint_copy(root)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    name = CONTRACTS[contract]
    assert f"{name} BROKEN" in out, out
    assert chain in out, out


# --- packaging: one top-level package, vconsole; the folders are the import names ------------

def test_every_product_folder_is_a_package_under_vconsole():
    """No source folder outside vconsole/ and no mapping: what people import is the tree."""
    assert "package-dir" not in SETUPTOOLS
    assert SETUPTOOLS["packages"]["find"]["include"] == ["vconsole*"]
    for name in ("engine", "wire", "telemetry", "security", "console", "shared"):
        assert not (REPO / name).exists(), f"{name}/ at the root again"
        assert (REPO / "vconsole" / name / "__init__.py").is_file(), name


def test_console_styles_are_package_data():
    assert (REPO / "vconsole" / "console" / "app.tcss").is_file()
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
OUTSIDE = ["engine", "wire", "telemetry", "security", "console", "shared", "support"]
INSIDE = ["vconsole", "vconsole.cli", "vconsole.commands", "vconsole.engine.core",
          "vconsole.engine.process.core_proc", "vconsole.engine.publish.publisher",
          "vconsole.shared.config", "vconsole.wire.protocol", "vconsole.telemetry.schema",
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
                     "vconsole/engine/publish/publisher.py", "vconsole/shared/config.py",
                     "vconsole/telemetry/schema.py", "vconsole/console/app.py",
                     "vconsole/console/app.tcss"):
        assert expected in names, expected
