"""The CLI: every subcommand is listed and has useful help."""

import subprocess
import sys

import pytest

from vconsole.cli import build_parser

SUBCOMMANDS = ["demo", "engine", "attach", "generate", "load", "set", "get", "top", "bench",
               "record", "replay"]


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
