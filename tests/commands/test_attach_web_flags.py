"""`vconsole attach --web` without a browser: the command line a tab's console runs, and the
flags refused before anything binds. (Which hosts count as loopback, and the server itself:
tests/console/test_attach_web_server.py; the browser test: tests/console/test_attach_web.py.)"""

from __future__ import annotations

import os
import socket
import sys

import pytest

pytest.importorskip("textual_serve", reason="textual-serve is not installed (the web extra)")

from vconsole.cli import build_parser, main  # noqa: E402
from vconsole.commands.attach import console_argv  # noqa: E402
from vconsole.console.web import WebConsole  # noqa: E402


@pytest.mark.parametrize("flags", [["--port", "0"], ["--host", "127.0.0.1"], ["--no-token"]])
def test_web_flags_need_web(flags, capsys):
    assert main(["attach", *flags]) == 2
    assert f"{flags[0]}: only with --web" in capsys.readouterr().err


def test_a_port_in_use_is_said_plainly(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["attach", "--web", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"--web: cannot serve on 127.0.0.1:{port}" in err and "Traceback" not in err


def test_a_tab_runs_attach_with_this_commands_way_to_the_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args([
        "attach", "--web", "--base-port", "6000", "--extra-telemetry", "tcp://127.0.0.1:7002",
        "--control-key-file", "k.key", "--host", "0.0.0.0", "--port", "9000"])
    from vconsole.cli import apply_base_port
    apply_base_port(args)
    argv = console_argv(args)
    assert argv[:4] == [sys.executable, "-m", "vconsole", "attach"]
    pairs = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert pairs == {"--telemetry": "tcp://127.0.0.1:6002", "--control": "tcp://127.0.0.1:6003",
                     "--extra-telemetry": "tcp://127.0.0.1:7002",
                     "--control-key-file": os.path.join(tmp_path, "k.key")}
    token = "tok-Zq8vXw3-distinctive-7741"
    web = WebConsole(argv, token=token)
    assert web.command_for(True).split()[-1] != "--readonly"
    assert web.command_for(False).endswith(" --readonly")       # a tab without the token
    for steer in (True, False):                                 # the token is no argument
        assert token not in web.command_for(steer)
        assert not any(token in a for a in web.argv_for(steer))
    # nor in a console's environment (the live one: tests/console/test_attach_web_server.py)
    from textual_serve.download_manager import DownloadManager

    from vconsole.console.web import ConsoleProcess

    async def nothing(*_: object) -> None:
        return None

    env = ConsoleProcess(web.argv_for(True), write_bytes=nothing, write_str=nothing,
                         close=nothing, download_manager=DownloadManager()
                         )._build_environment(80, 24)
    assert not any(token in k or token in v for k, v in env.items())


def test_readonly_makes_every_tab_read_only():
    args = build_parser().parse_args(["attach", "--web", "--readonly"])
    web = WebConsole(console_argv(args), token="t")
    assert web.command_for(True).endswith(" --readonly")
    assert web.command_for(False).count("--readonly") == 1


def test_a_vllm_server_is_watched_the_same_way():
    args = build_parser().parse_args(["attach", "--web", "--vllm", "http://127.0.0.1:8000",
                                      "--kv-events", "tcp://127.0.0.1:5557"])
    assert console_argv(args)[4:] == ["--vllm", "http://127.0.0.1:8000",
                                      "--kv-events", "tcp://127.0.0.1:5557"]


def test_a_bad_flag_is_said_once_at_start(tmp_path, capsys):
    assert main(["attach", "--web", "--vllm", "http://127.0.0.1:8000",
                 "--kv-events", "tcp://127.0.0.1:x"]) == 2
    assert "--kv-events" in capsys.readouterr().err
    assert main(["attach", "--web", "--vllm", "ftp://127.0.0.1:8000"]) == 2
    err = capsys.readouterr().err
    assert "--vllm: not an http(s) URL" in err and len(err.strip().splitlines()) == 1
    assert main(["attach", "--vllm", "ftp://127.0.0.1:8000"]) == 2      # the same without --web
    assert "--vllm: not an http(s) URL" in capsys.readouterr().err
    assert main(["attach", "--web", "--curve-server-public", str(tmp_path / "none.key"),
                 "--curve-client-key", str(tmp_path / "none.key_secret")]) == 2
    assert "vconsole attach:" in capsys.readouterr().err
