"""Request text on the ``sched`` topic, on the publisher's side: a real scheduler's snapshot and
its requests' token ids go through the inbox and the publisher thread's loop, which decodes
them (a byte-level detokenizer, as the built-in models') and sends bounded strings only when
the config asks and the socket may carry them."""

from __future__ import annotations

from typing import Any

import pytest

from support.recording_sender import RecordingSender
from support.scheduling import make_request, make_scheduler
from vconsole.engine.publish.inbox import Inbox
from vconsole.engine.publish.publish_loop import LoopStart, PublishLoop
from vconsole.engine.publish.request_rows import RequestRows
from vconsole.engine.publish.request_text import TextBook
from vconsole.engine.sched.scheduler import Scheduler
from vconsole.security.bind_policy import request_text_refusal
from vconsole.shared.config import EngineConfig, describe_config
from vconsole.telemetry import request_text, schema
from vconsole.telemetry.request_text import OUTPUT_TAIL_CHARS, PROMPT_HEAD_CHARS, TEXT_ROWS


def byte_text(ids: list[int]) -> str:
    """What the built-in models' byte-level tokenizer does: one token per byte."""
    return bytes(i % 256 for i in ids).decode("utf-8", "replace")


class Probe:
    def read(self) -> dict[str, Any]:
        return {"available": False}


class Publishing:
    """A scheduler whose snapshots go through an inbox to a publisher loop, as the engine
    process's feed hands them over."""

    def __init__(self, config: EngineConfig, refusal: str | None = None) -> None:
        self.sched: Scheduler = make_scheduler(256, max_model_len=4096, max_num_seqs=2)
        self.rows = RequestRows()
        self.inbox = Inbox(config)
        self.sender = RecordingSender()
        self.now = [100.0]
        start = LoopStart(config=config, announced=self.inbox.announced,
                          config_schema=describe_config(), steps_recorded=0, t0=100.0,
                          t0_wall=1.7e9, detokenize=byte_text, text_refusal=refusal)
        self.loop = PublishLoop(self.inbox, self.sender, Probe(), Probe(),
                                lambda: self.now[0], start)

    def snapshot(self) -> dict[str, Any]:
        """One snapshot as the feed submits it; the ``sched`` body that went out."""
        stats = self.sched.stats(10_000, self.rows)
        ids = list(stats.requests.columns["id"][:TEXT_ROWS])
        lists = []
        for rid in ids:
            req = self.sched.get_request(rid)
            assert req is not None
            lists.append((rid, req.prompt_token_ids, req.output_token_ids))
        self.inbox.submit_snapshot(stats, self.sched.kv_stats(), "running", 1, lists)
        self.now[0] += 1.0
        self.loop.pass_once(self.inbox.take())
        return self.sender.last("sched")


def prompt(text: str) -> list[int]:
    return list(text.encode())


def test_each_row_carries_its_prompt_head_and_its_output_tail_as_it_grows():
    pub = Publishing(EngineConfig(publish_request_text=True))
    pub.sched.add_request(make_request("a", prompt("What is the capital of France? " * 20)))
    pub.sched.add_request(make_request("b", prompt("hello")))
    body = pub.snapshot()
    assert body[request_text.FIELD] == {
        "a": [("What is the capital of France? " * 20)[:PROMPT_HEAD_CHARS], ""],
        "b": ["hello", ""]}
    req = pub.sched.get_request("a")
    assert req is not None
    req.output_token_ids.extend(prompt("Paris. ") * 40)       # 280 characters of output
    body = pub.snapshot()
    text = request_text.text_of(body, "a")
    assert text is not None and text.output_tail == ("Paris. " * 40)[-OUTPUT_TAIL_CHARS:]
    assert len(text.prompt_head) == PROMPT_HEAD_CHARS


def test_a_row_is_decoded_again_only_when_its_output_grew():
    book = TextBook(byte_text)
    prompt_b, output_b = [104], [33]
    rows = [("a", [104, 105], []), ("b", prompt_b, output_b)]
    assert book.body(rows) == {"a": ["hi", ""], "b": ["h", "!"]}
    decodes = book.decodes
    assert book.body(rows) == {"a": ["hi", ""], "b": ["h", "!"]}
    assert book.decodes == decodes
    output_b.append(63)                         # the engine appends to the request's list
    assert book.body([("b", prompt_b, output_b)]) == {"b": ["h", "!?"]}
    assert book.decodes == decodes + 1          # the tail only; "a" is gone from the map
    assert book.body([("b", [111], [])]) == {"b": ["o", ""]}    # a reused id: decoded anew


def test_a_tokenizer_that_raises_costs_that_rows_text_only():
    def broken(ids: list[int]) -> str:
        if 0 in ids:
            raise ValueError("no such token")
        return byte_text(ids)
    book = TextBook(broken)
    assert book.body([("bad", [0], []), ("good", [111, 107], [])]) == {
        "bad": ["", ""], "good": ["ok", ""]}


def test_noise_bytes_are_sent_as_text_and_packed_even_with_a_lone_surrogate():
    book = TextBook(lambda ids: "\x1b[2J\udcff" + byte_text(ids))
    body = book.body([("r", [0, 7, 27], [255, 254])])
    frames = schema.encode("sched", {"engine": "e", "rank": 0, "seq": 0, "ts": 1.0,
                                     request_text.FIELD: body})
    got = schema.decode(frames).payload[request_text.FIELD]["r"]
    assert got[0].startswith("\x1b[2J?")       # raw on the wire; printers escape it


def test_text_is_off_by_default_and_never_sent_where_the_socket_refuses_it():
    for config, refusal in [(EngineConfig(), None),
                            (EngineConfig(publish_request_text=True),
                             request_text_refusal("tcp://0.0.0.0:5572", curve=False))]:
        pub = Publishing(config, refusal)
        pub.sched.add_request(make_request("a", prompt("secret")))
        assert request_text.FIELD not in pub.snapshot()


def test_turning_text_off_stops_it_at_once_even_on_a_heartbeat_resend():
    pub = Publishing(EngineConfig(publish_request_text=True, heartbeat_interval_s=0.5))
    pub.sched.add_request(make_request("a", prompt("secret")))
    assert request_text.published(pub.snapshot())
    pub.inbox.update_config(EngineConfig(publish_request_text=False, heartbeat_interval_s=0.5))
    pub.now[0] += 1.0
    pub.loop.pass_once(pub.inbox.take())      # no new snapshot: the last one is re-sent
    resent = pub.sender.last("sched")
    assert resent is not None and request_text.FIELD not in resent


def test_only_the_first_rows_carry_text():
    pub = Publishing(EngineConfig(publish_request_text=True))
    for i in range(TEXT_ROWS + 40):
        pub.sched.add_request(make_request(f"r{i}", prompt(f"prompt {i}")))
    body = pub.snapshot()
    table = body["requests"]
    sent = body[request_text.FIELD]
    assert len(table) == TEXT_ROWS + 40 and len(sent) == TEXT_ROWS
    assert set(sent) == set(table.columns["id"][:TEXT_ROWS])


@pytest.mark.parametrize("endpoint, curve, refused", [
    ("ipc:///tmp/x/telemetry", False, False), ("tcp://127.0.0.1:5572", False, False),
    ("tcp://[::1]:5572", False, False), ("tcp://0.0.0.0:5572", False, True),
    ("tcp://*:5572", False, True), ("tcp://10.0.0.7:5572", True, False)])
def test_text_is_refused_beyond_loopback_without_curve(endpoint, curve, refused):
    why = request_text_refusal(endpoint, curve)
    assert (why is not None) == refused
    if refused:
        assert why is not None and endpoint in why and "CURVE" in why


def test_a_data_parallel_front_end_refuses_text_its_public_socket_may_not_carry(tmp_path, ctx):
    """The ranks publish on private sockets; the front end's control fan-out knows the public
    one and refuses a change turning text on before any rank is asked."""
    from vconsole.engine.dp.front.control_fanout import ControlFanout
    from vconsole.security.control_key import read_key_file
    from vconsole.wire.control_client import ControlClient

    why = request_text_refusal("tcp://0.0.0.0:5572", curve=False)
    fanout = ControlFanout(f"ipc://{tmp_path}/control", 2, ctx=ctx,
                           control_key_file=str(tmp_path / "control.key"),
                           text_refusal=why).start()
    try:
        with ControlClient(fanout.endpoint, key=read_key_file(fanout.control_key_file),
                           ctx=ctx) as client:
            reply = client.set_config({"publish_request_text": "true"})
        assert not reply["ok"] and reply["rejected"] == {"publish_request_text": why}
        assert reply["ranks"] == {}
    finally:
        fanout.close()


def test_a_side_that_failed_to_decode_is_decoded_again_on_the_next_snapshot():
    failing = [True]

    def flaky(ids: list[int]) -> str:
        if failing[0]:
            raise ValueError("a one-off failure")
        return byte_text(ids)
    book = TextBook(flaky)
    rows = [("r", prompt("hi"), prompt("yo"))]
    assert book.body(rows) == {"r": ["", ""]}
    failing[0] = False
    assert book.body(rows) == {"r": ["hi", "yo"]}     # same lists, nothing grew: retried


@pytest.mark.parametrize("refused", [False, True])
def test_the_data_parallel_proxy_strips_text_its_public_socket_may_not_carry(tmp_path, ctx,
                                                                               refused):
    """A rank can still publish text (its private socket allows it; a reloaded config file):
    the proxy takes it out of every sched message before the public socket, nothing else."""
    import zmq

    from vconsole.engine.dp.front.telemetry_proxy import TelemetryProxy

    pub = Publishing(EngineConfig(publish_request_text=True))
    pub.sched.add_request(make_request("a", prompt("secret prompt")))
    body = {**schema.make_envelope("e", 0, 0, 1.7e9), **pub.snapshot()}
    assert request_text.published(body)
    why = request_text_refusal("tcp://0.0.0.0:5572", curve=False) if refused else None
    rank = ctx.socket(zmq.PUB)
    rank.bind(f"ipc://{tmp_path}/rank")
    proxy = TelemetryProxy(f"ipc://{tmp_path}/public", ctx=ctx, text_refusal=why).start()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"sched")
        sub.connect(proxy.endpoint)
        proxy.connect(0, f"ipc://{tmp_path}/rank")
        while not sub.poll(50):                   # until both subscriptions are through
            rank.send_multipart(schema.encode("sched", body), copy=False)
        got = schema.decode(sub.recv_multipart()).payload
    finally:
        sub.close(0)
        proxy.close()
        rank.close(0)
    assert (request_text.FIELD in got) is not refused
    if refused:
        assert "secret" not in repr(got) and proxy.stripped > 0
    sent = schema.decode(schema.encode("sched", body)).payload
    assert got["requests"].ids == ["a"]                           # the rest as it was sent
    assert {k: v.tolist() for k, v in got["requests"].numeric.items()} == {
        k: v.tolist() for k, v in sent["requests"].numeric.items()}
    assert {k: v for k, v in got.items() if k not in ("requests", request_text.FIELD)} == {
        k: v for k, v in sent.items() if k not in ("requests", request_text.FIELD)}


def test_a_reloaded_file_drops_only_the_refused_text_and_applies_the_rest(tmp_path):
    from vconsole.engine.process.loop_control import LoopControl
    from vconsole.shared.config import ConfigUpdate, apply_update

    why = request_text_refusal("tcp://0.0.0.0:5572", curve=False)

    class Core:
        config, config_version = EngineConfig(), 0

        def apply_config(self, values: dict[str, Any]) -> ConfigUpdate:
            update = apply_update(self.config, values)
            self.config = update.config
            return update

    class Publisher:
        def refuses_text(self, values: dict[str, Any]) -> str | None:
            return why if request_text.turns_on(values) else None

        def update_config(self, config: EngineConfig) -> None: ...
        def publish_config(self, version: int, values: dict[str, Any]) -> None: ...

    path = tmp_path / "engine.toml"
    path.write_text("publish_request_text = true\ntelemetry_hz = 7.0\n")
    core = Core()
    loop = LoopControl(core, None, Publisher(), config_path=str(path),  # type: ignore[arg-type]
                       stopping=lambda: None, on_change=lambda: None)
    loop.reload("SIGHUP")
    assert core.config.telemetry_hz == 7.0 and not core.config.publish_request_text
    # a set is all-or-nothing: the text key refuses the whole change, naming why
    reply = loop._set_config({"publish_request_text": True, "telemetry_hz": 9.0}, 1)
    assert not reply["ok"] and reply["rejected"] == {"publish_request_text": why}
    assert core.config.telemetry_hz == 7.0
