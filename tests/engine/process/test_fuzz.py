"""Malformed messages on the engine's input and control sockets, while real requests run.

Hypothesis generates batches of broken messages (random bytes, too many frames, protocol maps
with the wrong value types, huge ints, NaN and infinities, ``v`` as ``true``/``1.0``/``2``/
``"1"``, array references to missing frames or with bad dtypes, adds with bad sampling, aborts
naming junk or another client's ids, unknown types; control bodies with junk ops, ids, keys and
values, some of them holding the engine's real control key) and throws them at one live engine
from raw DEALER sockets, while a normal `EngineClient` keeps submitting real requests. The
specification:

- every real request finishes, with the greedy output of an in-process engine, and its client
  hears of nothing else (no protocol error);
- after every batch of 52 the engine still serves a valid request sent after the junk on the
  same connection, and answers a ``get_config`` sent after the control junk (so each message
  was read, and no thread died); every reply it sends is a well-formed message;
- no junk ever changes the config: each ``set_config`` holding the key also holds at least one
  value that must be refused, and the config version stays where it was;
- afterwards the scheduler drains to zero waiting and running, the engine serves a new request,
  and its resident memory is back within `RSS_TOLERANCE` of the baseline taken after a warm-up.

Deterministic: ``derandomize=True`` (the same messages every run), no example database, no
shrinking (a failure reports the whole batch; shrinking against a live process would mostly
re-send it).
"""

from __future__ import annotations

import math
import random
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from support.live_engine import RssSampler, Telemetry, ipc_endpoints, reference_outputs
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.wire import control, protocol
from vconsole.wire.control_client import ControlClient

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ENGINE_ARGS = ["--model", "tiny", "--no-supervisor", "--num-kv-blocks", "256", "--block-size", "8",
               "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--policy", "priority",
               "--set", "telemetry_hz=20", "--set", "heartbeat_interval_s=0.25"]
EXAMPLES = 50             # x 52 messages (hypothesis overruns its choice budget near 100 a batch;
MIN_MESSAGES = 2_500      # 100 batches cost 14 s of the suite's CPU, 50 about 7)
# Resident memory may end this much above the warm baseline. The allocator keeps some freed
# memory (glibc arenas of three I/O threads, pymalloc pools) and the tiny model's activations
# vary with batch shapes, which costs a few MiB to a few tens of MiB; a leak of the fuzz
# messages themselves would cost more: the big frames alone add up to more than twice this
# (asserted below: ~180 MiB), so keeping even half of them would fail the check.
RSS_TOLERANCE = 64 << 20
BIG_SIZES = (256 << 10, 1 << 20, 2 << 20)
REPLY_TIMEOUT_S = 20.0
REAL_BATCH = 8

# --- the real load ---------------------------------------------------------------------------

rng = random.Random(9)
WORK = [([rng.randrange(3, 259) for _ in range(rng.randint(3, 16))], rng.randint(1, 6))
        for _ in range(24)]
REAL_IDS = [f"real-{i}" for i in range(64)]  # what the real client calls its requests


class RealLoad:
    """A normal client submitting `REAL_BATCH` requests at a time until stopped; every
    completion is kept with the index of its prompt in `WORK`."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self.done: list[tuple[int, Any]] = []
        self.errors: list[BaseException] = []
        self.protocol_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        try:
            with EngineClient(self.engine.endpoints["input"], self.engine.endpoints["output"],
                              timeout_s=30) as c:
                while not self._stop.is_set():
                    ids = {}
                    for _ in range(REAL_BATCH):
                        i = n % len(WORK)
                        rid = c.submit(prompt_token_ids=WORK[i][0], max_tokens=WORK[i][1],
                                       request_id=REAL_IDS[n % len(REAL_IDS)])
                        ids[rid] = i
                        n += 1
                    for rid, completion in c.gather(timeout_s=120).items():
                        self.done.append((ids[rid], completion))
                self.protocol_errors = list(c.protocol_errors)
        except BaseException as e:
            self.errors.append(e)

    def __enter__(self) -> RealLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(180)


# --- the junk ----------------------------------------------------------------------------------

HUGE_INTS = (2**64 - 1, 2**63, 2**63 - 1, -(2**63), 2**31, -(2**31) - 1, -1, 0)
ODD_FLOATS = (math.nan, -math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324)
SAMPLING_KEYS = (*protocol.SAMPLING_KEYS, "n", "logprobs", "", "MAX_TOKENS")
BAD_DTYPES = (b"<i4", b"<u8", b">i2", b"|i1", b"<f4", b"<f8", b"O", b"V8", b"|S4", b"M8", b"U2",
              b"", b"xyz", b"<i4\x00", b"i4,i4", b"(2,)i4", b"\xff\xfe", b"<i" + b"4" * 40)

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1), st.sampled_from(HUGE_INTS),
    st.floats(), st.sampled_from(ODD_FLOATS),
    st.text(max_size=12), st.binary(max_size=12),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    st.builds(msgpack.Timestamp, st.integers(-(2**40), 2**40), st.integers(0, 999_999_999)),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=4)),
                                            inner, max_size=3)),
    max_leaves=5)
versions = st.sampled_from([True, False, 1.0, 2, "1", b"\x01", 0, -1, None, 2**64 - 1, 1.5,
                            [1], {"v": 1}, math.nan])
request_ids = st.one_of(st.sampled_from(REAL_IDS), st.text(max_size=8),  # long ones, built
                        st.builds(str.__mul__, st.sampled_from("xé0-"), st.integers(250, 300)),
                        junk)
token_lists = st.one_of(st.lists(st.integers(0, 258), min_size=1, max_size=12),
                        st.lists(st.one_of(st.integers(-5, 300), st.sampled_from(HUGE_INTS),
                                           junk), max_size=12))
sampling_maps = st.dictionaries(
    st.sampled_from(SAMPLING_KEYS),
    st.one_of(st.integers(-3, 40), st.sampled_from(HUGE_INTS), st.sampled_from(ODD_FLOATS),
              st.floats(-2, 2), st.booleans(), st.lists(st.integers(-2, 300), max_size=4), junk),
    max_size=5)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def ext_ref(index: int, dtype: bytes, code: int = protocol.EXT_ARRAY) -> msgpack.ExtType:
    return msgpack.ExtType(code, struct.pack("<I", index) + dtype)


def add_header(**fields: Any) -> dict[str, Any]:
    head = {"v": 1, "type": "add", "request_id": "fz", "prompt_token_ids": [5, 6, 7],
            "sampling": {"max_tokens": 2}}
    head.update(fields)
    return head


# Headers msgpack-python will not write: reserved (negative) extension types, a timestamp of a
# length no timestamp has, a map with an integer key, a truncated map, deep nesting, a map that
# claims 4 billion entries.
HANDCRAFTED = (b"\x82\xa1v\x01\xa4type\xd4\x80\x00",
               b"\x82\xa1v\x01\xa4type\xc7\x03\xff\x00\x00\x00",
               b"\x83\xa1v\x01\xa4type\xa3add\xaarequest_id\xd5\xfe\x00\x00",
               b"\x82\xa1v\x01\x05\xa3add", b"\x83\xa1v\x01", b"\x91" * 5000 + b"\xc0",
               b"\x81\xa1v" + b"\x81\xa1v" * 2000 + b"\x01", b"\xdf\xff\xff\xff\xff")


@st.composite
def random_frames(draw) -> list[bytes]:
    first = draw(st.one_of(st.binary(max_size=48), st.sampled_from(HANDCRAFTED)))
    return [first, *draw(st.lists(st.binary(max_size=48), max_size=3))]


@st.composite
def too_many_frames(draw) -> list[bytes]:
    head = draw(st.one_of(st.builds(add_header, request_id=request_ids), junk))
    extra = draw(st.integers(protocol.MAX_FRAMES, 3 * protocol.MAX_FRAMES))
    return [pack(head), *[b"\x00\x00\x00\x00"] * extra]


@st.composite
def protocol_maps(draw) -> list[bytes]:
    """A map with protocol keys, each (if present) plausible or junk."""
    plausible = {
        "v": st.one_of(st.just(1), versions), "type": st.sampled_from(
            ["hello", "add", "abort", "ready", "outputs", "error", "heartbeat", "", "ADD"]),
        "request_id": request_ids, "prompt": st.text(max_size=24),
        "prompt_token_ids": token_lists, "sampling": st.one_of(sampling_maps, junk),
        "priority": st.one_of(st.integers(-5, 5), st.sampled_from(HUGE_INTS)),
        "request_ids": st.one_of(st.lists(request_ids, max_size=4), junk),
    }
    head = draw(st.fixed_dictionaries(
        {}, optional={k: st.one_of(s, junk) for k, s in plausible.items()}))
    extra = draw(st.lists(st.binary(max_size=16), max_size=3))
    return [pack(head), *extra]


@st.composite
def bad_versions(draw) -> list[bytes]:
    head = add_header(request_id=draw(request_ids))
    if draw(st.booleans()):
        head["v"] = draw(versions)
    else:
        del head["v"]
    return [pack(head)]


@st.composite
def bad_array_refs(draw) -> list[bytes]:
    frames = draw(st.lists(st.sampled_from([b"", b"\x01", b"\x01\x02\x03",
                                            b"\x05\x00\x00\x00", b"\x01" * 7, b"\x02" * 4096]),
                           max_size=protocol.MAX_FRAMES - 1))
    index = draw(st.one_of(st.integers(0, protocol.MAX_FRAMES + 1),
                           st.sampled_from([2**32 - 1, 2**31])))
    code = draw(st.sampled_from([protocol.EXT_ARRAY] * 4 + [0, 2, 127]))
    data = draw(st.one_of(st.builds(lambda d: struct.pack("<I", index) + d,
                                    st.sampled_from(BAD_DTYPES)),
                          st.binary(max_size=4)))
    field = draw(st.sampled_from(["prompt_token_ids", "sampling", "request_id", "priority"]))
    value = msgpack.ExtType(code, data)
    head = add_header(request_id=draw(request_ids))
    head[field] = {"stop_token_ids": value} if field == "sampling" else value
    return [pack(head), *frames]


@st.composite
def bad_sampling(draw) -> list[bytes]:
    head = add_header(request_id=draw(request_ids), sampling=draw(sampling_maps))
    if draw(st.booleans()):
        head["priority"] = draw(st.one_of(st.sampled_from(HUGE_INTS), junk))
    return [pack(head)]


@st.composite
def aborts(draw) -> list[bytes]:
    ids = draw(st.one_of(st.lists(request_ids, max_size=6), junk))
    return [pack({"v": 1, "type": "abort", "request_ids": ids})]


@st.composite
def unknown_types(draw) -> list[bytes]:
    head = {"v": 1, "type": draw(st.one_of(st.text(max_size=10), st.sampled_from(
        ["launch", "reboot", "Hello", "outputs", "ready"])))}
    if draw(st.booleans()):
        head["request_id"] = draw(request_ids)
    return [pack(head)]


@st.composite
def big_messages(draw) -> list[bytes]:
    """Messages of 256 KiB to 2 MiB: a leak of what the engine receives would show in its
    memory."""
    size = draw(st.sampled_from(BIG_SIZES))
    kind = draw(st.integers(0, 3))
    rid = draw(st.sampled_from(["big", "big-2", *REAL_IDS[:2]]))
    if kind == 0:                                   # garbage
        return [bytes([size % 251]) * size]
    if kind == 1:                                   # an array frame that is not whole <i4 items
        return [pack(add_header(request_id=rid, prompt_token_ids=ext_ref(1, b"<i4"))),
                b"\x01" * (size + 1)]
    if kind == 2:                                   # a valid array, far beyond max_model_len
        return [pack(add_header(request_id=rid, prompt_token_ids=ext_ref(1, b"<i4"))),
                b"\x07\x00\x00\x00" * (size // 4)]
    return [pack(add_header(request_id=rid)), *[b"\x00" * (size // 16)] * 16]  # too many frames


def control_messages(key: str) -> st.SearchStrategy[list[bytes]]:
    """Control frames as a DEALER sends them. Bodies with the real key always hold a value
    that must be refused, so nothing is ever applied."""
    must_refuse = st.sampled_from([
        ("max_num_seqs", 0), ("max_num_seqs", -1), ("max_num_seqs", 2**64 - 1),
        ("max_num_seqs", math.nan), ("max_num_seqs", math.inf), ("max_num_seqs", "many"),
        ("max_num_seqs", [1]), ("max_num_seqs", True), ("max_num_seqs", 1.5),
        ("telemetry_hz", math.nan), ("telemetry_hz", math.inf), ("telemetry_hz", -math.inf),
        ("telemetry_hz", "nan"), ("telemetry_hz", "inf"), ("telemetry_hz", 0),
        ("max_holding_seconds", -1.0), ("max_holding_seconds", math.nan),
        ("max_holding_seconds", "-inf"), ("max_holding_seconds", {"s": 1}),
        ("policy", "random"), ("policy", 1), ("policy", ""), ("policy", None),
        ("hybrid_aging_s", 0), ("client_heartbeat_s", math.inf), ("log_stats", None),
        ("enable_prefix_caching", "maybe"), ("enable_prefix_caching", 2),
        ("block_size", 32), ("model", "other"), ("no_such_key", 1), ("", 0),
        ("alert_waiting_warning", 2**30), ("max_prompt_chars", 2**64 - 1),
        ("max_consecutive_step_failures", msgpack.ExtType(1, b"\x00" * 8)),
    ])
    config_keys = st.sampled_from(["max_num_seqs", "telemetry_hz", "policy", "log_stats",
                                   "max_holding_seconds", "block_size", "model", "nope"])
    ops = st.one_of(st.sampled_from(["get_config", "set_config", "reboot", "", "GET_CONFIG"]),
                    junk)
    values = st.one_of(st.dictionaries(config_keys, junk, max_size=4), junk)

    @st.composite
    def body(draw) -> bytes:
        kind = draw(st.integers(0, 9))
        if kind == 0:
            return draw(st.binary(max_size=48))
        if kind == 1:
            return pack(draw(junk))
        if kind == 2:                               # the real key, a value that must be refused
            vals = draw(st.dictionaries(config_keys, junk, max_size=3))
            vals.update(draw(st.lists(must_refuse, min_size=1, max_size=3)))
            return pack({"op": "set_config", "values": vals, "key": key,
                         "id": draw(st.integers(0, 2**40))})
        req = draw(st.fixed_dictionaries({}, optional={
            "op": ops, "values": values, "id": st.one_of(st.integers(-(2**63), 2**64 - 1), junk),
            "key": st.one_of(st.text(max_size=70), st.just(key[:-1]), st.just(key.upper()),
                             junk)}))
        return pack(req)

    @st.composite
    def frames(draw) -> list[bytes]:
        shape = draw(st.integers(0, 5))
        if shape == 0:
            return [draw(body())]                   # no delimiter
        if shape == 1:
            return [b"", b""]                       # a delimiter and an empty body
        if shape == 2:
            return draw(st.lists(st.binary(max_size=24), min_size=1, max_size=5))
        if shape == 3:
            return [b"route", b"", draw(body())]
        return [b"", draw(body())]

    return frames()


@dataclass(frozen=True)
class Message:
    """Frames for one socket, ``"input"`` or ``"control"``; shown short when a batch fails."""

    socket: str
    frames: list[bytes]

    def __repr__(self) -> str:
        shown = ", ".join(repr(f) if len(f) <= 64 else f"{f[:64]!r}+{len(f) - 64}B"
                          for f in self.frames)
        return f"{self.socket}[{shown}]"


def batches(key: str) -> st.SearchStrategy[tuple[Message, ...]]:
    """52 messages of a fixed mix (hypothesis favours its first branches when it picks among
    alternatives, so the mix is laid out rather than drawn): twice 19 on the input socket (2 of
    them big) and 7 on the control socket."""
    def on_input(*kinds: st.SearchStrategy[list[bytes]]) -> list[st.SearchStrategy[Message]]:
        return [k.map(lambda f: Message("input", f)) for k in kinds]

    ctl = control_messages(key).map(lambda f: Message("control", f))
    mix = [*on_input(random_frames(), too_many_frames(), protocol_maps(), protocol_maps(),
                     bad_versions(), bad_array_refs(), bad_array_refs(), bad_sampling(),
                     bad_sampling(), aborts(), unknown_types(), big_messages()),
           ctl, ctl, ctl,
           *on_input(protocol_maps(), bad_array_refs(), bad_sampling(), random_frames(),
                     aborts(), unknown_types(), big_messages()),
           ctl, ctl, ctl, ctl]
    return st.tuples(*mix, *mix)


# --- the raw sockets -----------------------------------------------------------------------------

class FuzzSockets:
    """Raw DEALERs on the input (with its output DEALER, same identity) and control sockets.

    Every reply is read and checked to be well-formed. A *probe* is a valid request (on the
    input socket, after the junk on the same connection, so it is read after all of it) and a
    ``get_config`` (on the control socket, likewise): its answer shows both threads alive and
    done with everything sent before. `send_probe` sends one; `await_probes` waits for every
    answer, so a batch's probe can be answered while the next batch is generated."""

    def __init__(self, engine: EngineProcess, identity: bytes) -> None:
        ctx = zmq.Context.instance()
        self.inp, self.out, self.ctl = (ctx.socket(zmq.DEALER) for _ in range(3))
        for s in (self.inp, self.out):
            s.setsockopt(zmq.IDENTITY, identity)
        for s in (self.inp, self.out, self.ctl):
            s.setsockopt(zmq.LINGER, 0)
        self.out.setsockopt(zmq.RCVHWM, 0)
        self.out.connect(engine.endpoints["output"])
        self.inp.connect(engine.endpoints["input"])
        self.ctl.connect(engine.endpoints["control"])
        self.sent = 0
        self.sent_bytes = 0
        self.input_replies: dict[str, int] = {}
        self.control_replies = 0
        self.applied: list[dict[str, Any]] = []
        self._probes = 0
        self._input_probes: set[str] = set()     # probe request ids without a final output
        self._control_probes: set[int] = set()   # probe get_config ids without a reply
        self.waited_s = 0.0                      # in await_probes
        self.inp.send_multipart(protocol.encode_hello())
        assert self.out.poll(REPLY_TIMEOUT_S * 1000), "no engine answered hello"
        assert protocol.decode(self.out.recv_multipart())["type"] == protocol.READY

    def send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        self.sent += 1
        self.sent_bytes += sum(len(f) for f in frames)

    def send_probe(self) -> None:
        self._probes += 1
        rid = f"fuzz-probe-{self._probes:06d}"   # longer than any id the junk makes up
        self.inp.send_multipart(protocol.encode_add(
            rid, prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 1, "ignore_eos": True}))
        self._input_probes.add(rid)
        probe_id = -(2**62) - self._probes
        self.ctl.send_multipart([b"", control.encode_request("get_config",
                                                             request_id=probe_id)])
        self._control_probes.add(probe_id)

    def await_probes(self) -> None:
        start = time.monotonic()
        deadline = start + REPLY_TIMEOUT_S
        while self._input_probes or self._control_probes:
            assert time.monotonic() < deadline, (
                f"no answer to probes {sorted(self._input_probes)} (input) "
                f"{sorted(self._control_probes)} (control) within {REPLY_TIMEOUT_S:g} s")
            zmq.select([self.out, self.ctl], [], [], 0.05)
            self.drain()
        self.waited_s += time.monotonic() - start

    def drain(self) -> None:
        while self.out.poll(0):
            header = protocol.decode(self.out.recv_multipart())  # a malformed reply raises
            kind = header["type"]
            assert kind in protocol.ENGINE_TYPES, header
            self.input_replies[kind] = self.input_replies.get(kind, 0) + 1
            if kind == protocol.OUTPUTS:
                for out in header["outputs"]:
                    rid = out["request_id"]
                    if isinstance(rid, str) and rid in self._input_probes and out["finished"]:
                        assert out["finish_reason"] == "length", out
                        self._input_probes.discard(out["request_id"])
        while self.ctl.poll(0):
            reply = control.decode_reply(self.ctl.recv_multipart()[-1])
            self.control_replies += 1
            if reply["applied"]:
                self.applied.append(reply)
            if reply.get("id") in self._control_probes:
                assert reply["ok"], reply
                self._control_probes.discard(reply["id"])

    def close(self) -> None:
        for s in (self.inp, self.out, self.ctl):
            s.close(0)


# --- the test ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    # One torch thread: the other core is this process's, generating the junk.
    with EngineProcess(ENGINE_ARGS, endpoints=ipc_endpoints(d), log_path=d / "engine.log",
                       env={"OMP_NUM_THREADS": "1"}) as e:
        yield e


WARM_UP = [
    [b"\xc1 not msgpack"], [pack([1, 2])], [pack({"v": 1})], [pack({"v": True, "type": "add"})],
    [pack({"v": 1, "type": "launch", "request_id": "w"})],
    [pack(add_header(sampling={"temperature": math.nan}))],
    [pack(add_header(sampling={"max_tokens": 2**64 - 1}))],
    [pack(add_header(prompt_token_ids=ext_ref(3, b"<i4"))), b"\x00" * 8],
    [pack(add_header(prompt_token_ids=ext_ref(1, b"<f4"))), b"\x00" * 8],
    [pack({"v": 1, "type": "abort", "request_ids": [1, None]})],
    [pack({"v": 1, "type": "abort", "request_ids": REAL_IDS[:4]})],
    [pack(add_header()), *[b"x"] * 9],
]


def warm_up(engine: EngineProcess, fuzz: FuzzSockets) -> None:
    """Some junk of each kind (the big sizes included), a few control messages and a round of
    real requests, so the baseline includes what the engine allocates once: caches, log
    handlers, allocator arenas for big frames."""
    for frames in WARM_UP:
        fuzz.send(fuzz.inp, frames)
    for size in BIG_SIZES:
        for frames in _big_of_every_kind(size):
            fuzz.send(fuzz.inp, frames)
    for frames in ([b"", b"junk"], [b"", pack({"op": "reboot"})],
                   [b"", pack({"op": "set_config", "values": {"max_num_seqs": 0}})]):
        fuzz.send(fuzz.ctl, frames)
    fuzz.send_probe()
    fuzz.await_probes()
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
        for ids, max_tokens in WORK:
            c.submit(prompt_token_ids=ids, max_tokens=max_tokens)
        c.gather(timeout_s=60)


def _big_of_every_kind(size: int) -> list[list[bytes]]:
    return [[bytes([size % 251]) * size],
            [pack(add_header(request_id="big", prompt_token_ids=ext_ref(1, b"<i4"))),
             b"\x01" * (size + 1)],
            [pack(add_header(request_id="big", prompt_token_ids=ext_ref(1, b"<i4"))),
             b"\x07\x00\x00\x00" * (size // 4)],
            [pack(add_header(request_id="big")), *[b"\x00" * (size // 16)] * 16]]


def test_malformed_messages_never_disturb_real_requests_nor_the_engine(engine):
    expected = reference_outputs(WORK)
    key = engine.control_key()
    assert key
    telemetry = Telemetry(engine.endpoints["telemetry"])
    fuzz = FuzzSockets(engine, b"fuzzer")
    rss = RssSampler(engine.pid)
    try:
        warm_up(engine, fuzz)
        with ControlClient(engine.endpoints["control"], key=key) as ctl:
            config_before = ctl.get_config()
        baseline = rss.rss()

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.generate], print_blob=False,
                  suppress_health_check=list(HealthCheck))
        @given(batch=batches(key))
        def throw(batch: tuple[Message, ...]) -> None:
            fuzz.await_probes()  # the previous batch's
            for msg in batch:
                fuzz.send(fuzz.inp if msg.socket == "input" else fuzz.ctl, msg.frames)
                fuzz.drain()
            fuzz.send_probe()
            assert engine.child.poll() is None, engine.log_tail()

        t0, sent_before = time.monotonic(), fuzz.sent
        with RealLoad(engine) as load:
            throw()
            fuzz.await_probes()
        fuzz_s = time.monotonic() - t0
        sent = fuzz.sent - sent_before
        print(f"fuzz: {sent} messages in {fuzz_s:.1f} s ({fuzz.waited_s:.1f} s of it waiting "
              f"for probes), {fuzz.sent_bytes / 2**20:.0f} MiB with the warm-up; replies "
              f"{fuzz.input_replies}, control replies {fuzz.control_replies}; "
              f"{len(load.done)} real requests meanwhile")
        assert sent >= MIN_MESSAGES
        fuzz.close()  # the fuzzer's requests still in flight are aborted: its client is gone

        # Every real request finished with the greedy output, and its client heard of nothing
        # else.
        assert not load.errors, load.errors
        assert not load.protocol_errors, load.protocol_errors
        assert len(load.done) >= 4 * REAL_BATCH
        for i, done in load.done:
            assert done.finished and done.finish_reason in ("length", "stop"), done
            assert done.output_token_ids == expected[i], (i, done)

        # No junk changed the config.
        assert not fuzz.applied, fuzz.applied
        with ControlClient(engine.endpoints["control"], key=key) as ctl:
            config_after = ctl.get_config()
        assert config_after["version"] == config_before["version"]
        assert config_after["values"] == config_before["values"]

        # The scheduler drains, the engine serves, its memory is back near the baseline.
        telemetry.wait_for("sched", lambda s: s["num_waiting"] == 0 and s["num_running"] == 0,
                           since=time.monotonic(), timeout_s=60)
        with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
            done = c.generate(prompt_token_ids=WORK[0][0], max_tokens=WORK[0][1], timeout_s=30)
        assert done.output_token_ids == expected[0]
        assert engine.child.poll() is None
        after = rss.rss()
        print(f"engine RSS: baseline {baseline / 2**20:.0f} MiB, after {after / 2**20:.0f} MiB")
        assert fuzz.sent_bytes >= 2 * RSS_TOLERANCE  # a leak of the messages could not hide
        assert after <= baseline + RSS_TOLERANCE, (baseline, after)
    finally:
        fuzz.close()
        telemetry.close()


def test_an_unknown_type_naming_a_non_string_request_id_is_answered_and_serving_goes_on(engine):
    """Found by the fuzzer: ``{"v": 1, "type": "launch", "request_id": [1]}`` (a list, or a map,
    as the id of an unknown type) reached the busy loop as a request id and raised TypeError
    (unhashable) in the request registry: the engine process died."""
    fuzz = FuzzSockets(engine, b"fuzzer-2")
    try:
        for rid in ([1], {"a": 1}, 5, None, b"x", ""):
            fuzz.send(fuzz.inp, [pack({"v": 1, "type": "launch", "request_id": rid})])
        fuzz.send_probe()
        fuzz.await_probes()
    finally:
        fuzz.close()
    assert engine.child.poll() is None, engine.log_tail()
    with EngineClient(engine.endpoints["input"], engine.endpoints["output"]) as c:
        done = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)
        assert done.finish_reason == "length"


def test_an_unknown_type_naming_an_invalid_request_id_gets_an_error_naming_no_request(engine):
    fuzz = FuzzSockets(engine, b"fuzzer-3")
    replies = []
    try:
        for rid in ([1], 5, "", "x" * (protocol.MAX_REQUEST_ID_LEN + 1)):
            fuzz.send(fuzz.inp, [pack({"v": 1, "type": "launch", "request_id": rid})])
            while True:
                assert fuzz.out.poll(REPLY_TIMEOUT_S * 1000), "no reply"
                header = protocol.decode(fuzz.out.recv_multipart())
                if header["type"] != protocol.HEARTBEAT:
                    replies.append(header)
                    break
    finally:
        fuzz.close()
    assert [(r["type"], r.get("request_id")) for r in replies] == [(protocol.ERROR, None)] * 4
