"""The CLI: every subcommand is listed and has useful help."""

import os
import subprocess
import sys

import pytest

from vconsole.cli import build_parser

SUBCOMMANDS = ["demo", "engine", "attach", "generate", "load", "set", "get", "top", "bench",
               "record", "replay", "doctor"]


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
    assert version.returncode == 0 and version.stdout.startswith("vconsole ")


def test_base_port_moves_every_default_endpoint_but_not_an_explicit_one():
    from vconsole.cli import apply_base_port

    args = build_parser().parse_args(["engine", "--base-port", "6000",
                                      "--control", "ipc:///tmp/ctl"])
    apply_base_port(args)
    assert (args.input, args.output, args.telemetry, args.control) == (
        "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002", "ipc:///tmp/ctl")
    client = build_parser().parse_args(["attach", "--base-port", "6000"])
    apply_base_port(client)
    assert client.telemetry == "tcp://127.0.0.1:6002" and client.control == "tcp://127.0.0.1:6003"


def test_vconsole_base_port_moves_a_whole_shell_and_the_flag_wins(monkeypatch):
    from vconsole.cli import apply_base_port

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
