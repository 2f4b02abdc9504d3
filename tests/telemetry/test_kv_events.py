"""KV cache events in vLLM's wire format: what the pool records, how it is encoded, and a real
engine process publishing them to a subscriber written from vLLM's own event classes.

The structs below follow ``vllm/distributed/kv_events.py`` as of vLLM 0.33 (after vLLM PR
#42892, "Switch event structs from array to map encoding": events are tagged maps, the
``EventBatch`` stays an array ``[ts, events, data_parallel_rank]``); the replay framing follows
its ``ZmqEventPublisher._service_replay`` (``[identity, "", topic, seq, payload]``, ending with
``["", "", -1, ""]``). Decoding with msgspec and these exact classes is what a KV-aware router
(llm-d, Dynamo, AIBrix) does with vLLM's stream.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from support.zmq_wait import connect_joined
from vconsole.engine.kv.kv_cache_manager import KVCacheManager
from vconsole.engine.publish.kv_events import END_SEQ, KVEventPublisher
from vconsole.engine.request import Request
from vconsole.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vconsole.telemetry.kv_wire import encode_batch, offset_endpoint, u64
from vconsole.wire.sampling import SamplingParams

# --- vLLM's event classes (vllm/distributed/kv_events.py, 0.33) --------------------------------
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
B = 4


class Mirror:
    """What a router knows from the stream: the set of cached hashes, and the chains."""

    def __init__(self) -> None:
        self.stored: set[int] = set()
        self.parents: dict[int, int | None] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, VBlockStored):
                parent = ev.parent_block_hash
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                for h in ev.block_hashes:
                    self.stored.add(h)
                    self.parents[h] = parent
                    parent = h
            elif isinstance(ev, VBlockRemoved):
                for h in ev.block_hashes:
                    self.stored.discard(h)
            else:
                self.stored.clear()


def pool_hashes(kv: KVCacheManager) -> set[int]:
    return {u64(h) for h in kv.pool._cached}


def test_random_churn_the_stream_always_equals_the_pools_cached_blocks():
    """Requests with shared prefixes come and go in a small pool (evictions), prefix caching
    is switched off and on: replaying the encoded events always gives exactly the pool's set
    of cached hashes, and every stored block's parent was announced before it."""
    rng = random.Random(7)
    kv = KVCacheManager(24, B)
    kv.enable_events()
    mirror = Mirror()
    prefixes = [[rng.randrange(50) for _ in range(3 * B)] for _ in range(4)]
    live: list[Request] = []
    n = 0
    kinds: dict[type, int] = {}
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 4):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes)[:rng.randrange(B, 3 * B + 1)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 2 * B))]
            req = Request(f"r{n}", tokens, SamplingParams(max_tokens=4))
            n += 1
            blocks, cached = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - cached, blocks):
                req.num_computed_tokens = req.num_tokens
                kv.cache_blocks(req)
                live.append(req)
        if step in (150, 300):
            kv.set_prefix_caching(False)
            kv.set_prefix_caching(True)
        events = kv.take_events()
        for ev in events:
            kinds[type(ev)] = kinds.get(type(ev), 0) + 1
        if events:
            batch = DECODER.decode(encode_batch(time.time(), events, 0, "CPU"))
            for ev in batch.events:
                if isinstance(ev, VBlockStored) and ev.parent_block_hash is not None:
                    assert ev.parent_block_hash in mirror.stored | set(ev.block_hashes)
            mirror.apply(batch)
        assert mirror.stored == pool_hashes(kv), f"step {step}"
        kv.pool.check_invariants()
    assert kv.take_events() == []
    assert kinds[BlockStored] > 50 and kinds[BlockRemoved] > 20 and kinds[AllBlocksCleared] == 2


def test_chunked_prefill_decode_and_a_prefix_registered_first_by_another_request():
    """Blocks registered over several steps chain to the block before them; a block whose
    prefix another request registered first is not announced again, and the next block of
    that request chains to the other's hash; the stream still equals the pool."""
    kv = KVCacheManager(32, B)
    kv.enable_events()
    mirror, ever = Mirror(), set()

    def drain() -> list:
        batch = DECODER.decode(encode_batch(0.0, kv.take_events(), 0, "CPU"))
        for ev in batch.events:
            if isinstance(ev, VBlockStored):
                assert ev.parent_block_hash is None or ev.parent_block_hash in ever
                ever.update(ev.block_hashes)
        mirror.apply(batch)
        assert mirror.stored == pool_hashes(kv)
        return batch.events

    prefix = list(range(100, 100 + 3 * B))
    a = Request("a", prefix + [1, 2], SamplingParams(max_tokens=8))
    b = Request("b", prefix + [5, 6, 7, 8, 9], SamplingParams(max_tokens=8))
    for r in (a, b):                                # both admitted before either computed
        assert kv.allocate_slots(r, r.num_tokens)
    a.num_computed_tokens = B                       # a's prefill in chunks: 1 block ...
    kv.cache_blocks(a)
    first = drain()
    assert [len(e.block_hashes) for e in first] == [1] and first[0].parent_block_hash is None
    a.num_computed_tokens = a.num_tokens            # ... then the other two
    kv.cache_blocks(a)
    second = drain()
    assert [len(e.block_hashes) for e in second] == [2]
    assert second[0].parent_block_hash == first[0].block_hashes[0]
    b.num_computed_tokens = b.num_tokens            # b: three blocks already known, one new
    kv.cache_blocks(b)
    third = drain()
    assert [len(e.block_hashes) for e in third] == [1]
    assert third[0].parent_block_hash == second[0].block_hashes[-1]
    for t in range(2 * B):                          # b decodes: its fifth block fills
        b.output_token_ids.append(40 + t)
        b.num_computed_tokens += 1
        kv.cache_blocks(b)
        drain()
    assert len(ever) == 5
    kv.free(a)
    kv.free(b)
    drain()


def test_the_encoding_is_msgspecs_encoding_of_vllms_structs_byte_for_byte():
    events = [BlockStored([-5, 7], None, list(range(2 * B)), B), BlockRemoved([3]),
              AllBlocksCleared()]
    ours = encode_batch(1.5, events, 1, "GPU")
    theirs = msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[
        VBlockStored(block_hashes=[u64(-5), 7], parent_block_hash=None,
                     token_ids=list(range(2 * B)), block_size=B, lora_id=None, medium="GPU",
                     lora_name=None),
        VBlockRemoved(block_hashes=[3], medium="GPU"), VAllBlocksCleared()],
        data_parallel_rank=1))
    assert ours == theirs
    assert DECODER.decode(ours).events[0].block_hashes == [2**64 - 5, 7]


def test_events_off_records_nothing():
    kv = KVCacheManager(8, B)
    req = Request("a", list(range(3 * B)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    assert kv.pool.events is None and kv.take_events() == []


def test_offset_endpoint_follows_vllm():
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    with pytest.raises(ValueError):
        offset_endpoint("tcp://127.0.0.1", 1)


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            out.append(frames)
            if frames[2] == END_SEQ:
                break
        return out
    finally:
        dealer.close(0)


def test_publisher_sequence_topic_and_replay_framing():
    ctx = zmq.Context()
    pub = KVEventPublisher(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv-events",
                           buffer_steps=10).start()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"kv-events")
    sub.connect(pub.endpoint)
    try:
        got: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        i = 0
        while len(got) < 4 and time.monotonic() < deadline:   # a late joiner misses the first
            pub.publish([BlockRemoved([i])])
            i += 1
            if sub.poll(100):
                while sub.poll(0):
                    got.append(sub.recv_multipart())
        assert len(got) >= 4
        seqs = [int.from_bytes(f[1], "big") for f in got]
        assert all(f[0] == b"kv-events" and len(f[1]) == 8 for f in got)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))     # +1 each, no gap
        assert DECODER.decode(got[0][2]).events[0].block_hashes == [seqs[0]]
        last = seqs[-1]
        replayed = _replay(ctx, pub.replay_endpoint, last - 1)
        assert replayed[-1] == [b"", b"", END_SEQ, b""]
        body = replayed[:-1]
        assert [int.from_bytes(f[2], "big") for f in body][:2] == [last - 1, last]
        assert all(f[0] == b"" and f[1] == b"kv-events" for f in body)
        assert body[1][3] == got[-1][2]                   # the very bytes published
        old = _replay(ctx, pub.replay_endpoint, 0)        # only buffer_steps (10) are kept
        assert len(old) - 1 <= 10
    finally:
        sub.close(0)
        pub.close()
        ctx.term()


@pytest.mark.proc
@pytest.mark.slow
def test_a_live_engine_publishes_events_a_vllm_subscriber_decodes_and_replays(tmp_path):
    """A real engine process with ``--kv-events-endpoint``: requests sharing a prefix store
    blocks whose parent chains link; sequence numbers grow by one; switching prefix caching off
    clears the cache in the stream; replay returns the very batches published."""
    from vconsole.engine.client.client import EngineClient
    from vconsole.engine.launch.engine_process import EngineProcess
    from vconsole.wire.control_client import ControlClient

    eng = EngineProcess(["--model", "tiny", "--num-kv-blocks", "24", "--block-size", "8",
                         "--max-num-seqs", "4", "--kv-events-endpoint", "tcp://127.0.0.1:*",
                         "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"],
                        log_path=tmp_path / "engine.log").start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    try:
        eps = eng.ready["kv_events"]
        connect_joined(sub, eps["endpoint"])      # the subscription reaches the PUB
        prefix = list(range(100, 124))             # three full blocks shared by all
        with EngineClient(eng.endpoints["input"], eng.endpoints["output"]) as client:
            ids = [client.submit(prompt_token_ids=[*prefix, 7 + i, 8 + i], max_tokens=12,
                                 ignore_eos=True) for i in range(8)]
            client.gather(ids, timeout_s=120)
        with ControlClient(eng.endpoints["control"], timeout_s=30,
                           key=eng.control_key()) as control:
            assert control.set_config({"enable_prefix_caching": False})["ok"]
        got: list[list[bytes]] = []
        mirror = Mirror()
        ever_stored: set[int] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sub.poll(200):
                frames = sub.recv_multipart()
                got.append(frames)
                batch = DECODER.decode(frames[2])
                for ev in batch.events:
                    if isinstance(ev, VBlockStored):
                        if ev.parent_block_hash is not None:     # the chain links
                            assert ev.parent_block_hash in ever_stored
                        ever_stored.update(ev.block_hashes)
                mirror.apply(batch)
                if isinstance(batch.events[-1], VAllBlocksCleared):
                    break
        seqs = [int.from_bytes(f[1], "big") for f in got]
        assert seqs and seqs[0] == 0 and seqs == list(range(len(seqs)))
        batches = [DECODER.decode(f[2]) for f in got]
        assert all(b.data_parallel_rank == 0 for b in batches)
        stored = [e for b in batches for e in b.events if isinstance(e, VBlockStored)]
        assert len(stored) >= 1 and all(e.medium == "CPU" and e.block_size == 8 for e in stored)
        assert stored[0].parent_block_hash is None and stored[0].token_ids[:24] == prefix
        assert isinstance(batches[-1].events[-1], VAllBlocksCleared) and not mirror.stored
        replayed = _replay(ctx, eps["replay_endpoint"], 0)
        assert replayed[-1] == [b"", b"", END_SEQ, b""]
        assert [f[3] for f in replayed[:-1]] == [f[2] for f in got]
    finally:
        sub.close(0)
        ctx.term()
        eng.stop()
