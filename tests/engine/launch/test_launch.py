"""EngineLaunch: `vconsole engine`'s flags read once, and written back for a child or a rank.

The invariant every launcher relies on: parsing ``vconsole engine`` + `EngineLaunch.argv()` gives
back an equal launch, so a supervisor's child and a data-parallel rank run exactly the engine the
user asked for, with only what the launcher changed on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vconsole.cli import build_parser
from vconsole.commands.engine import launch_from_args
from vconsole.commands.flags import apply_base_port
from vconsole.engine.launch.launch import ChildOfSupervisor, EngineLaunch
from vconsole.shared.config import ConfigError


def parse(argv: list[str]) -> EngineLaunch:
    args = build_parser().parse_args(["engine", *argv])
    apply_base_port(args)
    return launch_from_args(args)


def round_trip(launch: EngineLaunch) -> EngineLaunch:
    return parse(launch.argv())


@pytest.fixture
def toml(tmp_path: Path) -> str:
    path = tmp_path / "engine.toml"
    path.write_text("max_num_seqs = 7\n[telemetry]\nconfig_interval_s = 2.0\n")
    return str(path)


@pytest.mark.parametrize("argv", [
    [],
    ["--model", "small-gqa", "--device", "cpu", "--dtype", "float32", "--block-size", "8",
     "--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
     "--policy", "priority", "--no-prefix-caching",
     "--set", "engine_id=e7", "--set", "heartbeat_interval_s=0.5"],
    ["--base-port", "23000", "--control-key-file", "/tmp/k", "--ready-file", "/tmp/r.json",
     "--allow-remote-telemetry", "--metrics-port", "0", "--metrics-host", "127.0.0.1",
     "--no-supervisor", "--max-restarts", "2", "--restart-window", "9.5",
     "--restart-backoff", "0.25", "--hang-timeout", "0"],
    ["--data-parallel-size", "2", "--dp-master-addr", "127.0.0.1", "--dp-master-port", "29511"],
    ["--telemetry", "ipc:///tmp/t", "--input=tcp://127.0.0.1:*",
     "--curve-server-key", "/k/server.key_secret", "--curve-clients", "/k/authorized_clients",
     "--dp-rank-host", "10.0.0.2", "--dp-curve-dir", "/k"],
])
def test_argv_gives_the_same_launch_back(argv: list[str]) -> None:
    launch = parse(argv)
    assert round_trip(launch) == launch


def test_a_config_file_and_overrides_survive_and_keep_their_order(toml: str) -> None:
    launch = parse(["--config", toml, "--max-num-seqs", "5", "--set", "max_num_seqs=6"])
    assert launch.config.max_num_seqs == 6          # file < flag < --set
    assert launch.config.config_interval_s == 2.0
    back = round_trip(launch)
    assert back == launch and back.source.config_file == toml  # a child reloads the same file


def test_the_child_of_a_supervisor_gets_its_hidden_flags_and_the_users_engine() -> None:
    launch = parse(["--max-num-seqs", "3", "--metrics-port", "9400", "--ready-file", "/pub"])
    child = launch.for_child(
        ChildOfSupervisor(liveness_file="/run/l", failure_file="/run/f", restart_count=2,
                          restart_reason="killed by SIGKILL"),
        {n: f"tcp://127.0.0.1:{5000 + i}" for i, n in
         enumerate(("input", "output", "telemetry", "control"))},
        ready_file="/run/ready", metrics=("127.0.0.1", 0))
    back = round_trip(child)
    assert back == child
    assert back.supervised_child and back.child == child.child
    assert back.config == launch.config
    assert back.ready_file == "/run/ready" and back.metrics == ("127.0.0.1", 0)
    assert back.endpoints["control"] == "tcp://127.0.0.1:5003"


def test_a_rank_is_the_same_engine_on_private_endpoints_without_public_parts() -> None:
    launch = parse(["--data-parallel-size", "2", "--max-num-seqs", "3", "--metrics-port", "0",
                    "--allow-remote-telemetry", "--control-key-file", "/pub.key",
                    "--ready-file", "/pub.json", "--allow-remote-metrics",
                    "--set", "policy=hybrid"])
    eps = {n: f"ipc:///run/r1-{n}" for n in ("input", "output", "telemetry", "control")}
    rank = launch.for_rank(1, 2, "127.0.0.1", 29600, eps, "/run/r1.key")
    assert (rank.config.dp_rank, rank.config.data_parallel_size,
            rank.config.dp_master_port) == (1, 2, 29600)
    assert rank.config.max_num_seqs == 3
    assert rank.metrics is None and not rank.allow_remote and rank.ready_file is None
    assert rank.control_key_file == "/run/r1.key" and dict(rank.endpoints) == eps
    assert round_trip(rank) == rank
    assert not launch.one_rank and rank.one_rank     # the launcher vs one of its ranks
    assert rank.config.policy == "hybrid"           # the user's --set reaches the rank
    argv = rank.argv()                              # none of the launcher's own flags
    assert not {"--metrics-port", "--allow-remote-metrics", "--ready-file",
                "--allow-remote-telemetry", "/pub.key"} & set(argv)


def test_a_bad_config_is_refused_when_the_launch_is_read() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        parse(["--set", "max_num_seqs=0"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse(["--set", "max_num_seqs"])
