"""The Ray launcher's pure parts, no Ray started: the flags survive the command line a wrapper
(`vconsole serve`) builds, a rank actor's death becomes a short reason for the front end's
error, and the rank's environment carries what a model load needs."""

from __future__ import annotations

import pytest

from vconsole.cli import build_parser
from vconsole.commands.engine import launch_from_args
from vconsole.engine.dp.ray.cluster import rank_env_vars
from vconsole.engine.dp.ray.launcher import death_reason, group_name
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
    env = rank_env_vars({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "VCONSOLE_BASE_PORT": "5570", "HOME": "/root", "SECRET": "x"})
    assert env == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "VCONSOLE_BASE_PORT": "5570"}
