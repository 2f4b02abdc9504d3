"""The engine's clients (`EngineClient`, `AsyncEngineClient`): ids checked before they leave,
timeouts without an engine, and both clients against a real engine process. The wire protocol
they speak: tests/wire/test_protocol.py."""

import asyncio
import threading

import pytest

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.client.client import Completion, EngineClient
from vconsole.wire import protocol
from vconsole.wire.outputs import RequestOutput


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
        # `tiny` decodes 400 tokens in under half a second: a client starved of CPU for that
        # long (a loaded CI machine) sends its abort after the request ended by length. That
        # race is the engine's right; the abort must win at least once in three tries, and a
        # request that lost it has all its tokens.
        reasons = []
        for _ in range(3):
            rid = await c.submit(prompt_token_ids=[9, 9, 9], max_tokens=400, ignore_eos=True)
            seen = []
            async for out in c.stream(rid):
                seen.append(out)
                if len(seen) == 2:
                    await c.abort([rid])
            assert seen[-1].finished
            reasons.append(seen[-1].finish_reason)
            got = sum(len(o.new_token_ids) for o in seen)
            if seen[-1].finish_reason == "abort":
                assert got < 400
                break
            assert seen[-1].finish_reason == "length" and got == 400
        assert reasons[-1] == "abort", reasons
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
