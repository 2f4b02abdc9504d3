"""The request wire protocol and the clients: framing round trips, rejections with reasons,
timeouts without an engine, and the asyncio client against a real engine process."""

import asyncio
import threading

import msgpack
import numpy as np
import pytest

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.client.client import Completion, EngineClient
from vconsole.wire import protocol
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.sampling import SamplingParams


def wire(frames):
    """What the receiver gets: bytes (and buffers) rather than the sender's objects."""
    return [memoryview(f).cast("B") if isinstance(f, np.ndarray) else bytes(f) for f in frames]


# --- protocol ------------------------------------------------------------------------------

def test_bulk_token_ids_travel_as_a_raw_frame_and_come_back_zero_copy():
    ids = np.arange(1000, dtype=np.int32)
    frames = protocol.encode_add("r1", prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=7, temperature=0.5, top_k=4, seed=3, stop_token_ids=(2, 5)), priority=-1)
    assert len(frames) == 2 and frames[1] is ids  # handed to zmq as is: no copy, no list
    header = protocol.decode(wire(frames))
    assert isinstance(header["prompt_token_ids"], np.ndarray)
    msg = protocol.parse_add(header)
    assert msg.prompt_token_ids == list(range(1000)) and msg.priority == -1
    assert msg.sampling == SamplingParams(max_tokens=7, temperature=0.5, top_k=4, seed=3,
                                          stop_token_ids=(2, 5))


def test_short_arrays_travel_inline():
    frames = protocol.encode_add("r1", prompt_token_ids=[1, 2, 3])
    assert len(frames) == 1
    assert protocol.parse_add(protocol.decode(wire(frames))).prompt_token_ids == [1, 2, 3]


def test_text_prompt_round_trip():
    msg = protocol.parse_add(protocol.decode(wire(protocol.encode_add("t", prompt="héllo"))))
    assert msg.prompt == "héllo" and msg.prompt_token_ids is None
    assert msg.sampling == SamplingParams()


def test_outputs_round_trip_inline_and_as_buffers():
    outs = [RequestOutput("a", [5]), RequestOutput("b", list(range(100)), finished=True,
                                                    finish_reason="length", text="xyz",
                                                    num_prompt_tokens=4, num_cached_tokens=2,
                                                    num_output_tokens=100, num_preemptions=1)]
    frames = protocol.encode_outputs(outs)
    assert len(frames) == 2  # only the long delta became a frame
    assert protocol.parse_outputs(protocol.decode(wire(frames))) == outs


@pytest.mark.parametrize("header,reason", [
    ({"type": "add", "prompt": "x"}, "request_id"),
    ({"type": "add", "request_id": "r", "prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
    ({"type": "add", "request_id": "r", "prompt": 5}, "prompt must be a string"),
    ({"type": "add", "request_id": "r", "prompt": "x", "sampling": {"max_tokens": 0}},
     "max_tokens"),
    ({"type": "add", "request_id": "r", "prompt": "x", "sampling": {"beams": 4}},
     "unknown sampling keys: beams"),
    ({"type": "add", "request_id": "r", "prompt": "x", "sampling": {"top_p": "high"}},
     "top_p must be a number"),
    ({"type": "add", "request_id": "r", "prompt_token_ids": [1, -2]}, "non-negative"),
    ({"type": "add", "request_id": "r", "prompt": "x", "priority": 1.5}, "priority"),
    ({"type": "add", "request_id": "r", "prompt": "x", "priority": 2**31},
     r"priority must be within -2147483648\.\.2147483647"),
    ({"type": "add", "request_id": "r", "prompt": "x", "sampling": {"ignore_eos": 1}},
     "ignore_eos must be a boolean"),
])
def test_malformed_add_is_rejected_with_a_reason_naming_the_request(header, reason):
    with pytest.raises(protocol.ProtocolError, match=reason) as e:
        protocol.parse_add(protocol.decode(wire(protocol.encode(header))))
    if "request_id" in header:
        assert e.value.request_id == "r"


@pytest.mark.parametrize("frames,reason", [
    ([], "empty"),
    ([b"\xc1"], "undecodable"),
    ([msgpack.packb([1, 2])], "must be a msgpack map"),
    ([msgpack.packb({"v": 2, "type": "add"})], "protocol version 2"),
    ([msgpack.packb({"v": 1})], "no 'type'"),
    ([msgpack.packb({"v": 1, "type": "add", "p": msgpack.ExtType(9, b"12345")})], "extension"),
    ([msgpack.packb({"v": 1, "type": "add", "p": msgpack.ExtType(1, b"\x05\0\0\0<i4")})],
     "frame 5"),
    ([msgpack.packb({"v": 1, "type": "add", "p": msgpack.ExtType(1, b"\x01\0\0\0<f4")}), b"0000"],
     "integer"),
    ([msgpack.packb({"v": 1, "type": "add", "p": msgpack.ExtType(1, b"\x01\0\0\0<i4")}), b"000"],
     "whole number"),
    ([b"x"] * 9, "too many frames"),
])
def test_undecodable_messages_raise_protocol_errors_only(frames, reason):
    with pytest.raises(protocol.ProtocolError, match=reason):
        protocol.decode(frames)


@pytest.mark.parametrize("version", [True, 1.0, "1", None, 2])
def test_the_version_must_be_the_integer_one(version):
    frame = msgpack.packb({"v": version, "type": "add", "request_id": "r"})
    with pytest.raises(protocol.ProtocolError, match="version") as e:
        protocol.decode([frame])
    assert e.value.request_id == "r"


def test_a_message_naming_a_request_keeps_its_id_even_when_its_frames_are_bad():
    """Too many frames, or an array reference to a frame that is not there: the error still
    names the request, so the engine can answer it with that request's final output."""
    ids = np.arange(40, dtype=np.int32)
    good = protocol.encode_add("mine", prompt_token_ids=ids)
    with pytest.raises(protocol.ProtocolError, match="too many frames") as e:
        protocol.decode([*good, *[b"pad"] * protocol.MAX_FRAMES])
    assert e.value.request_id == "mine"
    with pytest.raises(protocol.ProtocolError, match="refers to frame") as e:
        protocol.decode(good[:1])  # the array's frame is missing
    assert e.value.request_id == "mine"


@pytest.mark.parametrize("sampling,reason", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -1e-30}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stop_token_ids": [1, -5]}, "non-negative"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": 1.0}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
])
def test_sampling_values_that_would_sample_wrongly_are_refused(sampling, reason):
    header = {"type": "add", "request_id": "r", "prompt": "x", "sampling": sampling}
    with pytest.raises(protocol.ProtocolError, match=reason):
        protocol.parse_add(protocol.decode(wire(protocol.encode(header))))


def test_size_limits_are_checked_before_any_per_token_work():
    header = {"type": "add", "request_id": "r", "prompt": "x" * 101}
    with pytest.raises(protocol.ProtocolError, match="max_prompt_chars 100") as e:
        protocol.parse_add(header, max_prompt_chars=100)
    assert e.value.request_id == "r"
    ids = np.zeros(5000, dtype=np.int32)
    with pytest.raises(protocol.ProtocolError, match="5000 tokens cannot fit"):
        protocol.parse_add({"type": "add", "request_id": "r", "prompt_token_ids": ids},
                           max_prompt_tokens=2047)


def test_the_new_sampling_keys_travel_and_are_kept():
    sampling = {"min_p": 0.1, "min_tokens": 3, "presence_penalty": 0.5,
                "frequency_penalty": -0.5, "repetition_penalty": 1.3, "max_tokens": 8}
    header = {"type": "add", "request_id": "r", "prompt": "x", "sampling": sampling}
    got = protocol.parse_add(protocol.decode(wire(protocol.encode(header)))).sampling
    assert (got.min_p, got.min_tokens, got.presence_penalty, got.frequency_penalty,
            got.repetition_penalty) == (0.1, 3, 0.5, -0.5, 1.3)


def test_completion_accumulates_deltas():
    c = Completion("r")
    c.add(RequestOutput("r", [1, 2], num_prompt_tokens=3))
    c.add(RequestOutput("r", [3], finished=True, finish_reason="stop", text="abc"))
    assert c.output_token_ids == [1, 2, 3] and c.finished and c.text == "abc"


def test_unknown_sampling_argument_is_a_type_error(tmp_path):
    c = EngineClient(f"ipc://{tmp_path}/i", f"ipc://{tmp_path}/o")
    c._connected = True
    with pytest.raises(TypeError, match="beam_width"):
        c.submit("x", beam_width=2)
    c.close()


@pytest.mark.parametrize("rid,reason", [
    ("x" * (protocol.MAX_REQUEST_ID_LEN + 1), "1..256 characters, got 257"),
    ("", "1..256 characters, got 0"),
    (17, "must be a string, got int"),
], ids=["too-long", "empty", "not-a-string"])
def test_an_id_the_engine_would_refuse_never_leaves_the_client(tmp_path, rid, reason):
    with pytest.raises(ValueError, match=reason):
        protocol.encode_add(rid, prompt="x")
    c = EngineClient(f"ipc://{tmp_path}/i", f"ipc://{tmp_path}/o")
    c._connected = True
    with pytest.raises(ValueError, match=reason):
        c.submit("x", request_id=rid)
    assert c.num_in_flight == 0
    c.close()
    protocol.encode_add("x" * protocol.MAX_REQUEST_ID_LEN, prompt="x")  # the limit itself is ok


# --- no engine -----------------------------------------------------------------------------

def test_sync_client_without_engine_times_out_clearly(tmp_path):
    c = EngineClient(f"ipc://{tmp_path}/i", f"ipc://{tmp_path}/o", timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"no engine answered at input=ipc://.*within 0.2s"):
        c.connect()
    c.close()


async def test_async_client_without_engine_times_out_clearly(tmp_path):
    c = AsyncEngineClient("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no engine answered"):
        async with c:
            pass


# --- against an engine ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(shared_engine):
    """The session's shared engine (tests/conftest.py): these tests only use it."""
    return shared_engine


@pytest.mark.proc
def test_sync_client_streams_deltas_then_a_final_output(engine):
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
        assert c.engine_info["vocab_size"] == 259 and c.engine_info["block_size"] == 8
        rid = c.submit("hello", max_tokens=5, ignore_eos=True)
        outs = list(c.stream(rid, timeout_s=30))
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert sum(len(o.new_token_ids) for o in outs) == 5
        assert outs[-1].finish_reason == "length" and outs[-1].text is not None
        assert outs[-1].num_prompt_tokens == 5
        assert c.num_in_flight == 0


@pytest.mark.proc
async def test_async_client_many_requests_in_flight(engine):
    async with AsyncEngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
        prompts = [[3 + i, 4 + i, 5 + i] for i in range(20)]
        results = await asyncio.gather(*(c.generate(prompt_token_ids=p, max_tokens=4,
                                                    ignore_eos=True, priority=i % 3)
                                         for i, p in enumerate(prompts)))
        assert all(r.finish_reason == "length" and len(r.output_token_ids) == 4 for r in results)
        # Same prompt twice (greedy): same tokens, whatever else was batched with it.
        again = await c.generate(prompt_token_ids=prompts[7], max_tokens=4, ignore_eos=True)
        assert again.output_token_ids == results[7].output_token_ids


@pytest.mark.proc
async def test_async_stream_and_abort(engine):
    async with AsyncEngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
        rid = await c.submit(prompt_token_ids=[9, 9, 9], max_tokens=400, ignore_eos=True)
        seen = []
        async for out in c.stream(rid):
            seen.append(out)
            if len(seen) == 2:
                await c.abort([rid])
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        deltas = []
        async for out in c.generate_stream("abc", max_tokens=3, ignore_eos=True):
            deltas.append(out)
        assert deltas[-1].finished and sum(len(d.new_token_ids) for d in deltas) == 3


@pytest.mark.proc
def test_two_clients_at_once_each_get_only_their_outputs(engine):
    eps = engine.endpoints["input"], engine.endpoints["output"]
    with EngineClient(*eps) as a, EngineClient(*eps) as b:
        ra = [a.submit(prompt_token_ids=[20, i], max_tokens=3) for i in range(5)]
        rb = [b.submit(prompt_token_ids=[30, i], max_tokens=3) for i in range(5)]
        assert set(b.gather()) == set(rb)
        assert set(a.gather()) == set(ra)


LONG_ID = "x" * 300  # the engine refuses it and cannot name it in its error


@pytest.mark.proc
def test_an_error_the_engine_cannot_attribute_fails_unanswered_requests_instead_of_hanging(
        engine, monkeypatch):
    monkeypatch.setattr(protocol, "MAX_REQUEST_ID_LEN", 1000)  # an older/buggy client's check
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
        ok = c.submit(prompt_token_ids=[40, 41], max_tokens=60, ignore_eos=True)
        ok_stream = c.stream(ok, timeout_s=30)
        first = next(ok_stream)  # answered: it cannot be the dropped message
        c.submit(prompt_token_ids=[42], max_tokens=3, request_id=LONG_ID)
        got: list = []
        t = threading.Thread(target=lambda: got.extend(c.stream(LONG_ID)), daemon=True)
        t.start()
        t.join(15)  # default timeout: without the fix this waits forever
        assert not t.is_alive(), "stream() of a request the engine dropped never returned"
        (final,) = got
        assert final.finished and final.finish_reason == "error"
        assert "could not attribute" in final.error and "request_id must be" in final.error
        assert any("request_id must be" in e for e in c.protocol_errors)
        rest = list(ok_stream)
        assert rest[-1].finish_reason == "length"
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 60
        assert c.num_in_flight == 0


@pytest.mark.proc
async def test_async_client_fails_unanswered_requests_on_an_unattributed_error(
        engine, monkeypatch):
    monkeypatch.setattr(protocol, "MAX_REQUEST_ID_LEN", 1000)
    async with AsyncEngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
        await c.submit(prompt_token_ids=[43], max_tokens=3, request_id=LONG_ID)

        async def final():
            return [o async for o in c.stream(LONG_ID)][-1]

        out = await asyncio.wait_for(final(), 15)
        assert out.finish_reason == "error" and "request_id must be" in out.error
        done = await asyncio.wait_for(c.generate(prompt_token_ids=[44], max_tokens=2,
                                                 ignore_eos=True), 30)
        assert done.finish_reason == "length"  # the client keeps working


def test_logprobs_travel_with_their_tokens_and_a_bad_entry_is_refused():
    out = RequestOutput("r", [4, 5], logprobs=[(-0.5, [4, 9], [-0.5, -1.5]), (-2.0, [], [])])
    back = protocol.parse_outputs(protocol.decode(wire(protocol.encode_outputs([out]))))[0]
    assert back.logprobs == [(-0.5, [4, 9], [-0.5, -1.5]), (-2.0, [], [])]
    plain = protocol.parse_outputs(protocol.decode(wire(protocol.encode_outputs(
        [RequestOutput("r", [4])]))))[0]
    assert plain.logprobs is None
    bad = {"type": "outputs", "outputs": [{"request_id": "r", "new_token_ids": [4],
                                           "finished": False,
                                           "logprobs": [[-1.0, [1, 2], [-1.0]]]}]}
    with pytest.raises(protocol.ProtocolError, match="differ in length"):
        protocol.parse_outputs(bad)
