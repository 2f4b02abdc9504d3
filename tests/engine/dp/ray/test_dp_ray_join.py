"""`--ray-address`: the engine joins a Ray cluster somebody started (`ray start --head`), serves
on it, and leaves it running with nothing of the engine's in it. Long (a Ray of its own plus an
engine): `make test-long`; the owned-Ray module (`test_dp_ray.py`) covers the rank behaviour."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from vconsole.engine.client.client import EngineClient
from vconsole.engine.dp.ray.cluster import processes_of, start_head, use_token_file, write_token
from vconsole.engine.launch.engine_process import EngineProcess

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.proc, pytest.mark.slow, pytest.mark.long]


def test_an_engine_joins_a_running_cluster_and_leaves_it_as_it_found_it(tmp_path: Path) -> None:
    temp = Path("/tmp") / f"vcrt-{tmp_path.name[-8:]}"
    temp.mkdir()
    token = write_token(temp)       # the cluster's token, as `ray start` keeps one
    head = start_head(temp, 4, token, loopback=False)    # as a plain `ray start --head`
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    try:
        address = f"127.0.0.1:{head.port}"
        engine = EngineProcess(["--data-parallel-size", "2", "--data-parallel-backend", "ray",
                                "--ray-address", address, "--num-kv-blocks", "64",
                                "--block-size", "8"],     # joins with the cluster's token
                               env={"RAY_AUTH_TOKEN_PATH": str(token)}).start(timeout_s=240)
        try:
            ranks = engine.ready["ranks"]
            assert [r["actor"] for r in ranks] == ["vconsole_dp_rank_0", "vconsole_dp_rank_1"]
            with EngineClient(engine.endpoints["input"], engine.endpoints["output"],
                              timeout_s=30) as c:
                ids = [c.submit(prompt_token_ids=[4, 5, i], max_tokens=6) for i in range(8)]
                done = c.gather(ids, timeout_s=60)
            assert [done[i].finish_reason for i in ids] == ["length"] * 8
        finally:
            code = engine.stop(grace_s=60)
        assert code == 0, engine.log_tail(40)
        use_token_file(token)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            deadline = time.monotonic() + 10
            while {g["state"] for g in ray.util.placement_group_table().values()} - {"REMOVED"}:
                assert time.monotonic() < deadline, ray.util.placement_group_table()
                time.sleep(0.2)
            assert ray.available_resources().get("CPU") == 4.0     # nothing of ours holds any
            with pytest.raises(ValueError):
                ray.get_actor("vconsole_dp_rank_0", namespace=ranks[0]["namespace"])
        finally:
            ray.shutdown()
        assert processes_of(temp)            # the cluster the engine joined still runs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        head.stop()
        deadline = time.monotonic() + 10
        while processes_of(temp) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_of(temp) == []
        shutil.rmtree(temp, ignore_errors=True)
