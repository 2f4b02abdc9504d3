"""The request wire protocol (`vconsole.wire.protocol`): framing round trips, and malformed or
out-of-range messages rejected with reasons that name their request. The clients that speak it:
tests/engine/client/test_client.py."""

import msgpack
import numpy as np
import pytest

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
                                                    num_output_tokens=100, num_preemptions=1,
                                                    timings={"queue_s": 0.5},
                                                    config_version=3)]
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
