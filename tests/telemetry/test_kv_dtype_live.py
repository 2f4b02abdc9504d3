"""Issue #30, seen from outside a real engine started with ``--kv-cache-dtype int8`` (the alias):
its ready file, every ``kv`` message, ``/metrics``, ``vconsole doctor`` and ``vconsole top
--once --json`` all name the stored format (spelled out), its bytes per token and the pool's
capacity in tokens, and agree with each other.

The engine runs the torch attention path (``VCONSOLE_ATTENTION_KERNEL=torch``): what is tested
here is what it says of its pool, not the kernel, and it sits idle.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import pytest

from support.live_engine import Telemetry, ipc_endpoints
from vconsole.commands import top as top_cmd
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.tools import doctor

pytestmark = pytest.mark.proc

NUM_BLOCKS, BLOCK_SIZE = 48, 8
ARGS = ["--model", "tiny", "--kv-cache-dtype", "int8", "--num-kv-blocks", str(NUM_BLOCKS),
        "--block-size", str(BLOCK_SIZE), "--metrics-port", "0",
        "--set", "heartbeat_interval_s=0.2"]
INT8 = "int8_per_token_head"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("kvdtype")
    with EngineProcess(ARGS, endpoints=ipc_endpoints(d), log_path=d / "engine.log",
                       env={"VCONSOLE_ATTENTION_KERNEL": "torch"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def kv(engine):
    tel = Telemetry(engine.endpoints["telemetry"])
    try:
        return tel.wait_for("kv", lambda p: True)
    finally:
        tel.close()


def test_the_ready_file_names_the_stored_format_and_its_bytes_per_token(engine):
    ready = engine.ready
    assert ready["kv_cache_dtype"] == INT8                 # the alias spelled out
    # tiny: 4 layers x 2 KV heads x head_dim 64 -> K and V of (64 int8 + a float32 scale)
    assert ready["kv_bytes_per_token"] == 2 * 4 * 2 * (64 + 4)


def test_every_kv_message_carries_dtype_bytes_per_token_and_capacity(engine, kv):
    assert kv["cache_dtype"] == INT8
    assert kv["bytes_per_token"] == engine.ready["kv_bytes_per_token"]
    assert kv["capacity_tokens"] == NUM_BLOCKS * BLOCK_SIZE == kv["num_blocks"] * kv["block_size"]
    assert kv["pool_bytes"] == NUM_BLOCKS * BLOCK_SIZE * kv["bytes_per_token"]


def test_metrics_cache_config_info_carries_the_cache_dtype(engine, kv):
    text = urllib.request.urlopen(engine.ready["metrics"], timeout=10).read().decode()
    info = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert f'cache_dtype="{INT8}"' in info and f'num_gpu_blocks="{NUM_BLOCKS}"' in info
    assert "vconsole:kv_cache_bytes_per_token{" in text
    per_token = next(ln for ln in text.splitlines()
                     if ln.startswith("vconsole:kv_cache_bytes_per_token{"))
    assert float(per_token.rsplit(" ", 1)[1]) == kv["bytes_per_token"]


def test_doctor_names_the_running_engines_kv_format(engine, kv):
    check = doctor.check_kv_cache(engine.endpoints, "the endpoints given")
    assert check.status == doctor.OK
    assert f"stores {INT8}" in check.detail
    assert f"{kv['bytes_per_token']:,} B/token" in check.detail
    assert f"{NUM_BLOCKS * BLOCK_SIZE:,} tokens" in check.detail
    assert "kv_cache_dtype=int8" in check.detail           # as configured


def test_top_once_json_has_the_kv_format(engine, capsys):
    rc = top_cmd.main(argparse.Namespace(telemetry=engine.endpoints["telemetry"],
                                         control=engine.endpoints["control"], once=True,
                                         json=True, timeout=20.0))
    out, err = capsys.readouterr()
    assert rc == 0, err
    snap = json.loads(out)["kv"]
    assert (snap["cache_dtype"], snap["capacity_tokens"]) == (INT8, NUM_BLOCKS * BLOCK_SIZE)
    assert snap["bytes_per_token"] == engine.ready["kv_bytes_per_token"]
