"""A CPU engine's OpenMP threads spin briefly, then sleep between regions
(``GOMP_SPINCOUNT=2000``) unless the user chose a policy: threads that spin long collapse beside
any other busy process (the module docstring has the figures)."""

import os

import pytest

from support.live_engine import ipc_endpoints
from vconsole.engine import omp_wait
from vconsole.engine.launch.engine_process import EngineProcess


def test_a_short_spin_is_set_on_a_cpu_machine_when_the_user_chose_nothing():
    env: dict[str, str] = {"PATH": "/bin"}
    assert omp_wait.prefer_short_spin(env, gpu=False) == "spin 2000 rounds, then sleep"
    assert env["GOMP_SPINCOUNT"] == "2000"


@pytest.mark.parametrize(("chosen", "said"), [
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "active"),
    ({"OMP_WAIT_POLICY": "passive"}, "passive"),
    ({"GOMP_SPINCOUNT": "10000"}, "spin 10000 rounds, then sleep"),
])
def test_a_policy_the_user_chose_is_kept(chosen, said):
    env = dict(chosen)
    assert omp_wait.prefer_short_spin(env, gpu=False) == said
    assert env == chosen


def test_a_gpu_machine_keeps_the_library_default():
    env: dict[str, str] = {}
    assert omp_wait.prefer_short_spin(env, gpu=True) == "library default"
    assert env == {}


@pytest.mark.proc
@pytest.mark.skipif(os.path.exists(omp_wait.GPU_DEVICE), reason="a GPU machine keeps spinning")
def test_the_engine_process_spins_briefly_and_says_so(tmp_path, monkeypatch):
    for knob in omp_wait.USER_KNOBS:
        monkeypatch.delenv(knob, raising=False)
    args = ["--model", "tiny", "--num-kv-blocks", "16", "--no-supervisor"]
    # GNU OpenMP prints the settings it read at start-up: what the library itself saw (its
    # default spins 300000 times before it sleeps)
    with EngineProcess(args, endpoints=ipc_endpoints(tmp_path),
                       env={"OMP_DISPLAY_ENV": "VERBOSE"}) as engine:
        log = engine.log_text()
    assert "GOMP_SPINCOUNT = '2000'" in log
    assert "OpenMP threads wait: spin 2000 rounds, then sleep" in log
