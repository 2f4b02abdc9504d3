"""Request text in a data-parallel group is decided by the PUBLIC telemetry endpoint: a torchrun
rank (private loopback endpoints, which alone would allow text) starts with it off when the
public socket may not carry it, and the front end's proxy gets the same refusal."""

from __future__ import annotations

from typing import Any

import pytest

from vconsole.cli import build_parser
from vconsole.commands import engine as engine_cmd
from vconsole.engine.dp.front import stack as stack_module
from vconsole.engine.dp.front.stack import FrontEndStack
from vconsole.shared.config import EngineConfig
from vconsole.wire.ready_file import ENDPOINT_NAMES


@pytest.mark.parametrize("public, text", [("tcp://0.0.0.0:5572", False),
                                          ("tcp://127.0.0.1:5572", True)])
def test_a_torchrun_rank_turns_text_off_when_the_public_socket_refuses_it(monkeypatch, public,
                                                                          text):
    served: list[Any] = []
    monkeypatch.setattr(engine_cmd, "_serve", lambda launch, **_: served.append(launch) or 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = build_parser().parse_args(["engine", "--model", "tiny", "--telemetry", public,
                                      "--allow-remote-telemetry",
                                      "--set", "publish_request_text=true"])
    assert engine_cmd._torchrun_rank(engine_cmd.launch_from_args(args)) == 0
    (rank,) = served
    assert rank.endpoints["telemetry"].startswith("tcp://127.0.0.1:")   # private: allowed
    assert rank.config.publish_request_text is text


def test_the_front_ends_proxy_gets_the_public_sockets_text_refusal(tmp_path, monkeypatch):
    monkeypatch.setattr(stack_module, "request_text_refusal", lambda ep, curve: f"no: {ep}")
    public = {n: f"ipc://{tmp_path}/{n}" for n in ENDPOINT_NAMES}
    stack = FrontEndStack(EngineConfig(), public, 2, announce=False,
                          control_key_file=str(tmp_path / "control.key"))
    try:
        assert stack.proxy.text_refusal == f"no: {public['telemetry']}" == stack.text_refusal
    finally:
        stack.close()
