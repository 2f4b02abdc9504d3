"""The Ray launcher's pure parts, no Ray started: the flags survive the command line a wrapper
(`vconsole serve`) builds, a rank actor's death becomes a short reason for the front end's
error, the rank's environment carries what a model load needs and no secret, a GPU share fits,
and a Ray we start gets a private token."""

from __future__ import annotations

import math
import stat
from pathlib import Path

import pytest

from vconsole.cli import build_parser
from vconsole.commands.engine import launch_from_args
from vconsole.engine.dp.ray.cluster import (
    RANK_ENV,
    SECRET_LIKE,
    TOKEN_FILE,
    head_env,
    rank_env_vars,
    token_env,
    write_token,
)
from vconsole.engine.dp.ray.launcher import death_reason, gpu_share, group_name
from vconsole.engine.launch.launch import EngineLaunch


def parse(argv: list[str]) -> EngineLaunch:
    return launch_from_args(build_parser().parse_args(["engine", *argv]))


@pytest.mark.parametrize("argv", [
    ["--data-parallel-size", "2", "--data-parallel-backend", "ray"],
    ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ray-address", "auto"],
    ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ray-address",
     "10.0.0.1:6379", "--dp-curve-dir", "keys"],
    ["--data-parallel-size", "2"],
])
def test_the_backend_flags_survive_the_launch_command_line(argv: list[str]) -> None:
    launch = parse(argv)
    assert parse(launch.argv()) == launch
    assert launch.dp_backend == ("ray" if "ray" in argv else "mp")


def test_a_ray_kill_an_oom_and_a_lost_node_read_as_short_reasons() -> None:
    assert death_reason(RuntimeError("The actor died because it was killed by `ray.kill`."),
                        1) == "Ray actor vconsole_dp_rank_1 killed by ray.kill"
    assert "out of memory" in death_reason(
        RuntimeError("Task was killed due to the node running low on memory (OOM)"), 0)
    assert death_reason(RuntimeError("The actor died because its node has died."),
                        2) == "Ray actor vconsole_dp_rank_2: its node died"
    assert death_reason(RuntimeError("\n  something else\n"), 0) == \
        "Ray actor vconsole_dp_rank_0: something else"
    assert group_name(3) == "dp_rank_3"


def test_a_rank_actor_gets_the_model_loading_environment_and_nothing_else() -> None:
    needed = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/m/hf",
              "VCONSOLE_CACHE": "/m/vc", "VCONSOLE_KERNEL_CACHE": "/m/k",
              "VCONSOLE_STACKS_METHOD": "py-spy", "VCONSOLE_ATTENTION_KERNEL": "sdpa",
              "TOKENIZERS_PARALLELISM": "false"}
    secrets = {"HF_TOKEN": "hf_x", "HUGGING_FACE_HUB_TOKEN": "hf_y", "VCONSOLE_API_KEY": "k",
               "VCONSOLE_SECRET": "s", "HF_API_KEY": "a", "RAY_AUTH_TOKEN": "t",
               "VCONSOLE_PASSWORD": "p", "AWS_SECRET_ACCESS_KEY": "a", "SECRET": "x",
               "VCONSOLE_BASE_PORT": "5570", "HOME": "/root", "HF_UNKNOWN_THING": "?"}
    assert rank_env_vars({**needed, **secrets}) == needed
    assert not any(SECRET_LIKE.search(name) for name in RANK_ENV)
    # A Ray we start (whose raylet the rank workers inherit from): all but the secrets.
    assert head_env({**needed, **secrets}) == {
        **needed, "VCONSOLE_BASE_PORT": "5570", "HOME": "/root", "HF_UNKNOWN_THING": "?"}


@pytest.mark.parametrize(("gpus", "world", "share"), [
    (0, 2, 0.0), (2, 2, 1.0), (4, 2, 1.0), (1, 2, 0.5), (2, 3, 0.5), (1, 3, 0.3333),
    (1, 6, 0.1666), (2, 5, 0.3333), (3, 8, 0.3333), (1, 7, 0.1428), (4, 6, 0.5)])
def test_a_shared_gpu_share_fits_ceil_world_over_gpus_ranks_on_one_gpu(
        gpus: int, world: int, share: float) -> None:
    assert gpu_share(gpus, world) == share
    if 0 < share < 1:       # Ray places a fractional request on one GPU: every rank fits
        per_gpu = math.floor(1 / share + 1e-9)
        assert per_gpu * gpus >= world and per_gpu * share <= 1.0


def test_an_owned_ray_gets_a_private_token_and_token_auth_whatever_the_environment(
        tmp_path: Path) -> None:
    folder = tmp_path / "vcray"
    folder.mkdir(mode=0o700)
    path = write_token(folder)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 32
    assert path.parent == folder and path.name == TOKEN_FILE
    assert token_env(path) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    with pytest.raises(FileExistsError):        # never reused or overwritten
        write_token(folder)
