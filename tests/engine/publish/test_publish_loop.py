"""The publisher thread's loop on its own: an inbox, a sender and a clock, no publisher.

The loop runs one way: what the engine handed over comes in through `Inbox.take`, every message
goes out through the sender, and the loop never reaches back into `TelemetryPublisher`.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from support.recording_sender import RecordingSender
from vconsole.engine.publish import publish_loop
from vconsole.engine.publish.inbox import Inbox
from vconsole.engine.publish.publish_loop import LoopStart, PublishLoop
from vconsole.shared.config import EngineConfig, describe_config


class Probe:
    def read(self) -> dict[str, Any]:
        return {"available": False}


def make_loop(config: EngineConfig) -> tuple[Inbox, RecordingSender, PublishLoop, list[float]]:
    inbox, sender, now = Inbox(config), RecordingSender(), [100.0]
    start = LoopStart(config=config, announced=inbox.announced, config_schema=describe_config(),
                      steps_recorded=0, t0=now[0], t0_wall=1.7e9)
    return inbox, sender, PublishLoop(inbox, sender, Probe(), Probe(), lambda: now[0], start), now


def test_the_first_pass_sends_every_due_topic_through_the_sender():
    inbox, sender, loop, _ = make_loop(EngineConfig())
    loop.pass_once(inbox.take())
    assert sender.topics() == ["config", "gpu", "host", "health"]
    config = dict(sender.messages)["config"]
    assert config["version"] == 0 and config["values"] == EngineConfig().to_dict()


def test_an_announcement_in_the_handoff_goes_out_at_once_and_is_kept_by_the_loop():
    inbox, sender, loop, now = make_loop(EngineConfig())
    loop.pass_once(inbox.take())
    sender.messages.clear()
    inbox.publish_config(3, {"max_num_seqs": 4})
    now[0] += 0.01
    loop.pass_once(inbox.take())
    assert sender.topics() == ["config"]
    assert sender.messages[0][1]["version"] == 3
    assert loop.config_msg == (3, {"max_num_seqs": 4}) == inbox.announced


def test_reported_errors_reach_health_through_the_handoff():
    inbox, sender, loop, now = make_loop(EngineConfig())
    inbox.report_error("snapshot", "boom")
    loop.pass_once(inbox.take())
    alerts = [b for t, b in sender.messages if t == "alert"]
    health = dict(sender.messages)["health"]
    assert [a["name"] for a in alerts] == ["telemetry_error"]
    assert health["telemetry_errors"] == 1


def test_the_loop_module_does_not_import_the_publisher():
    tree = ast.parse(inspect.getsource(publish_loop))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "vconsole.engine.publish.publisher" not in imported
