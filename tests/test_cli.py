"""The CLI: every subcommand is listed and has useful help."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import vconsole
from vconsole.cli import build_parser

SUBCOMMANDS = ["demo", "engine", "serve", "attach", "replay", "generate", "load", "set", "get",
               "profile", "top", "stacks", "bench", "record", "trace", "keys", "doctor", "whatif"]


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "vconsole.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert f"    {name} " in out or f"    {name}\n" in out, name


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_exits_zero(name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([name, "--help"])
    assert exc.value.code == 0
    assert "usage: vconsole " + name in capsys.readouterr().out


def test_client_commands_share_engine_endpoint_defaults():
    p = build_parser()
    engine = p.parse_args(["engine"])
    for cmd in (["load"], ["set", "a=1"], ["get"], ["top"], ["attach"], ["record", "f"]):
        args = p.parse_args(cmd)
        for ep in ("input", "output", "telemetry", "control"):
            assert getattr(args, ep) == getattr(engine, ep)
            assert "127.0.0.1" in getattr(args, ep)


def help_of(name: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([name, "--help"])
    return " ".join(capsys.readouterr().out.split())    # argparse wraps at the terminal width


def test_each_command_lists_only_the_flags_it_uses_and_states_its_defaults(capsys):
    engine = help_of("engine", capsys)
    assert "--data-parallel-size" in engine and "reloaded on SIGHUP" in engine
    assert "--hang-timeout" in engine
    for name in ("generate", "demo"):
        text = help_of(name, capsys)
        assert "--data-parallel-size" not in text and "--dp-" not in text, name
        assert "SIGHUP" not in text, name
    assert "--control-key-file" not in help_of("top", capsys)
    assert "(default 10)" in help_of("top", capsys)
    load = help_of("load", capsys)
    assert "all sent at once" in load and "no limit" in load
    assert "until Ctrl-C" in help_of("record", capsys)
    assert "prompt_token_ids" in help_of("generate", capsys)


def test_bare_vconsole_prints_its_help_and_version_is_there():
    bare = subprocess.run([sys.executable, "-m", "vconsole"], capture_output=True, text=True)
    assert bare.returncode == 2 and "usage: vconsole" in bare.stdout
    assert "demo" in bare.stdout and "Traceback" not in bare.stderr
    version = subprocess.run([sys.executable, "-m", "vconsole", "--version"],
                             capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout == f"vconsole {vconsole.__version__}\n"


def test_the_package_version_is_the_projects():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert vconsole.__version__ == pyproject["project"]["version"]


def test_help_loads_parsers_only():
    """`vconsole --help` builds every command's parser and imports no handler: no engine,
    telemetry, console, server or tools package, no torch, textual or zmq."""
    code = ("import sys; from vconsole.cli import build_parser; build_parser(); "
            "print(' '.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "textual", "zmq", "transformers")
             or m.startswith(("vconsole.engine", "vconsole.telemetry", "vconsole.console",
                              "vconsole.entrypoints", "vconsole.tools", "vconsole.whatif"))]
    assert heavy == []
    commands = {m.rsplit(".", 1)[1] for m in loaded if m.startswith("vconsole.commands.")}
    assert commands.isdisjoint({"demo", "engine", "serve", "attach", "bench", "control", "top"})
    assert {"demo_flags", "bench_flags", "control_flags"} <= commands


def test_base_port_moves_every_default_endpoint_but_not_an_explicit_one():
    from vconsole.commands.flags import apply_base_port

    args = build_parser().parse_args(["engine", "--base-port", "6000",
                                      "--control", "ipc:///tmp/ctl"])
    apply_base_port(args)
    assert (args.input, args.output, args.telemetry, args.control) == (
        "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002", "ipc:///tmp/ctl")
    client = build_parser().parse_args(["attach", "--base-port", "6000"])
    apply_base_port(client)
    assert client.telemetry == "tcp://127.0.0.1:6002" and client.control == "tcp://127.0.0.1:6003"


def test_vconsole_base_port_moves_a_whole_shell_and_the_flag_wins(monkeypatch):
    from vconsole.commands.flags import apply_base_port

    monkeypatch.setenv("VCONSOLE_BASE_PORT", "7100")
    get = build_parser().parse_args(["get"])
    apply_base_port(get)
    assert get.control == "tcp://127.0.0.1:7103"
    flag = build_parser().parse_args(["top", "--base-port", "6000"])
    apply_base_port(flag)
    assert flag.telemetry == "tcp://127.0.0.1:6002"
    demo = build_parser().parse_args(["demo"])
    apply_base_port(demo)
    assert demo.base_port == 7100
    monkeypatch.setenv("VCONSOLE_BASE_PORT", "http")
    bad = subprocess.run([sys.executable, "-m", "vconsole", "get"], capture_output=True,
                         text=True, env={**os.environ})
    assert bad.returncode == 2
    assert "VCONSOLE_BASE_PORT must be a port from 1 to 65532, not 'http'" in bad.stderr


def test_a_subcommand_reports_an_unknown_flag_with_its_own_usage():
    """``vconsole engine --modle tiny`` printed the top-level usage (argparse hands a
    subcommand's leftovers to the top parser); the engine's own usage and the nearest flag."""
    typo = subprocess.run([sys.executable, "-m", "vconsole", "engine", "--modle", "tiny"],
                          capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.startswith("usage: vconsole engine ")
    assert "vconsole engine: error: unrecognized arguments: --modle tiny (did you mean --model?)" \
        in typo.stderr
    stray = subprocess.run([sys.executable, "-m", "vconsole", "load", "--nmu", "3"],
                           capture_output=True, text=True, timeout=60)
    assert stray.stderr.startswith("usage: vconsole load ") and "--num?" in stray.stderr
    top = subprocess.run([sys.executable, "-m", "vconsole", "--bogus", "engine"],
                         capture_output=True, text=True, timeout=60)
    assert top.stderr.startswith("usage: vconsole [-h]")   # before the subcommand: the top's


@pytest.mark.parametrize("cmd", [["engine"], ["serve"], ["demo"],
                                 ["generate", "--input", "i", "--output", "o"]])
def test_max_model_len_is_a_flag_of_every_engine_command(cmd):
    from vconsole.engine.config_source import config_from_args

    args = build_parser().parse_args([*cmd, "--max-model-len", "96"])
    assert config_from_args(args).max_model_len == 96
    given_later = build_parser().parse_args([*cmd, "--max-model-len", "96",
                                             "--set", "max_model_len=80"])
    assert config_from_args(given_later).max_model_len == 80    # --set wins, as over any flag


def test_max_model_len_travels_to_a_supervised_child_and_a_demo_engine():
    from vconsole.commands.demo import engine_args_from
    from vconsole.commands.engine import launch_from_args

    launch = launch_from_args(build_parser().parse_args(["engine", "--max-model-len", "96"]))
    child = launch_from_args(build_parser().parse_args(["engine", *launch.argv()]))
    assert launch.config.max_model_len == child.config.max_model_len == 96
    demo_argv = engine_args_from(build_parser().parse_args(["demo", "--max-model-len", "64"]))
    assert launch_from_args(build_parser().parse_args(
        ["engine", *demo_argv])).config.max_model_len == 64


def test_a_bad_max_model_len_is_refused_before_the_engine_loads():
    zero = subprocess.run([sys.executable, "-m", "vconsole", "engine", "--max-model-len", "0"],
                          capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2
    assert "invalid config: max_model_len: must be >= 1; got 0" in zero.stderr
    word = subprocess.run([sys.executable, "-m", "vconsole", "engine", "--max-model-len", "x"],
                          capture_output=True, text=True, timeout=60)
    assert word.returncode == 2 and "--max-model-len: invalid int value: 'x'" in word.stderr
