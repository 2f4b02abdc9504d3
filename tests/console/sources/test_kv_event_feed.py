"""Following KV events as vLLM publishes them: every encoding vLLM has used, the prefix cache
mirror, a gap caught up through the replay socket, and the console's vLLM source following a
live engine's /metrics and KV events together.

Encodings follow ``vllm/distributed/kv_events.py``: positional arrays before vLLM PR #42892
(``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]``, batch
``[ts, events, dp_rank]``), tagged maps after it; the map-shaped batch is what the newest
stored revision's ``EventBatch`` (no ``array_like``) would give.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from vconsole.console.sources.kv_events import (
    Cleared,
    KVEventFeed,
    PrefixCacheMirror,
    Removed,
    Stored,
    decode_batch,
)
from vconsole.engine.publish.kv_events import KVEventPublisher
from vconsole.shared.kv_events import BlockRemoved, BlockStored
from vconsole.telemetry.kv_wire import encode_batch, u64


def test_positional_tagged_map_and_map_batches_all_decode_to_the_same_events():
    positional = msgpack.packb([1.5, [["BlockStored", [1, 2], None, [7, 7, 7, 7], 2, None, "GPU"],
                                      ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]], 0])
    oldest = msgpack.packb([1.5, [["BlockStored", [1, 2], None, [7, 7, 7, 7], 2, None],
                                  ["BlockRemoved", [1]], ["AllBlocksCleared"]]])
    tagged = encode_batch(1.5, [BlockStored([1, 2], None, [7, 7, 7, 7], 2), BlockRemoved([1])],
                          0, "GPU")
    as_map = msgpack.packb({"ts": 1.5, "events": [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [7, 7, 7, 7], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}, {"type": "SomethingNewer", "x": 1}],
        "data_parallel_rank": 3})
    want = [Stored([1, 2], None, 2), Removed([1]), Cleared()]
    assert decode_batch(positional) == (1.5, want, 0)
    assert decode_batch(oldest) == (1.5, want, None)
    assert decode_batch(tagged) == (1.5, want[:2], 0)
    assert decode_batch(as_map) == (1.5, want, 3)          # an unknown kind is skipped
    with pytest.raises(ValueError):
        decode_batch(b"\xc1garbage")
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb({"no": "batch"}))


def test_the_mirror_keeps_the_cached_set_chain_depths_and_rates():
    m = PrefixCacheMirror()
    m.apply([Stored([b"a", b"b"], None, 16)], now=0.0)
    m.apply([Stored([b"c"], b"b", 16), Stored([b"x"], None, 16)], now=1.0)
    assert m.depth == {b"a": 1, b"b": 2, b"c": 3, b"x": 1}
    m.apply([Removed([b"x"])], now=2.0)
    s = m.summary(now=2.0)
    assert s["cached_blocks"] == 3 and s["longest_prefixes_blocks"] == [3, 2, 1]
    assert s["stored_total"] == 4 and s["removed_total"] == 1 and s["block_size"] == 16
    assert s["stored_per_s"] == pytest.approx(2 / 2.0) and s["removed_per_s"] == pytest.approx(0.5)
    m.apply([Cleared()], now=3.0)
    assert m.summary(now=3.0)["cached_blocks"] == 0 and m.cleared_total == 1


def _replayed(ctx: zmq.Context, endpoint: str) -> dict[int, bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        return dict(KVEventFeed._replay(dealer, 0))
    finally:
        dealer.close(0)


def test_a_gap_is_caught_up_through_the_replay_socket_before_the_newer_batch():
    ctx = zmq.Context()
    pub = KVEventPublisher(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*").start()
    try:
        batches = [[BlockStored([10 * i + 1], 10 * (i - 1) + 1 if i else None, [0] * 4, 4)]
                   for i in range(6)]
        for b in batches:
            pub.publish(b)
        deadline = time.monotonic() + 10
        while pub.seq < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        payloads = _replayed(ctx, pub.replay_endpoint)
        assert sorted(payloads) == list(range(6))
        feed = KVEventFeed("tcp://127.0.0.1:1", [0], replay_endpoint=pub.replay_endpoint)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        feed.handle(0, 0, payloads[0], dealer)
        feed.handle(0, 5, payloads[5], dealer)          # 1..4 never arrived: a gap
        dealer.close(0)
        assert feed.gaps == 1 and feed.replayed == 4 and feed.last_seq[0] == 5
        mirror = feed.mirrors[0]
        assert set(mirror.depth) == {u64(10 * i + 1) for i in range(6)}
        assert max(mirror.depth.values()) == 6          # the chain links across the gap
        assert feed.summary(0)["stored_total"] == 6
        # The publisher starts over (the server restarted): what the mirror held is gone.
        feed.handle(0, 0, payloads[0])
        assert feed.restarts == 1 and set(mirror.depth) == {u64(1)}
        # A gap with no replay socket cannot be filled: the mirror starts again from now.
        feed.handle(0, 3, payloads[3])
        assert feed.unrecovered == 1 and set(mirror.depth) == {u64(31)}
        assert feed.summary(0)["unrecovered"] == 1
    finally:
        pub.close()
        ctx.term()


@pytest.mark.proc
@pytest.mark.slow
def test_the_vllm_source_follows_a_live_engines_metrics_and_kv_events(tmp_path):
    """`attach --vllm URL --kv-events EP` against our own engine: its /metrics has vLLM's names
    and its KV events vLLM's format, so the source shows the prefix cache's contents."""
    from vconsole.console.sources.vllm import VllmSource
    from vconsole.console.state import ConsoleState
    from vconsole.engine.client.client import EngineClient
    from vconsole.engine.launch.engine_process import EngineProcess

    eng = EngineProcess(["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8",
                         "--metrics-port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:*"],
                        log_path=tmp_path / "engine.log").start()
    source = VllmSource(eng.ready["metrics"], interval_s=0.3, local_gpu=False,
                        kv_events=eng.ready["kv_events"]["endpoint"])
    state = ConsoleState()
    try:
        source.start(state)
        deadline = time.monotonic() + 60
        while source.feed is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert source.feed is not None
        prefix = list(range(100, 132))                  # four full blocks shared by all
        with EngineClient(eng.endpoints["input"], eng.endpoints["output"]) as client:
            # The feed's SUB has joined the engine's PUB once it hears an event: one-block
            # requests of their own tokens until it does (a PUB of events has no heartbeat).
            poke = 0
            while source.feed.summary(0) is None:
                assert time.monotonic() < deadline, "the feed never heard a KV event"
                poke += 1
                client.gather([client.submit(prompt_token_ids=[140 + poke % 100] * 9, max_tokens=1)],
                              timeout_s=60)
            ids = [client.submit(prompt_token_ids=[*prefix, 3 + i], max_tokens=4,
                                 ignore_eos=True) for i in range(4)]
            client.gather(ids, timeout_s=120)
        pc = None
        while time.monotonic() < deadline:
            with state.lock:
                eng_state = state.engine()
                kv = eng_state.latest.get("kv") if eng_state else None
                pc = kv.get("prefix_cache") if kv else None
            if pc and pc["cached_blocks"] >= 4 and max(pc["longest_prefixes_blocks"], default=0) >= 4:
                break
            time.sleep(0.2)
        assert pc is not None and pc["cached_blocks"] >= 4 and pc["block_size"] == 8
        assert max(pc["longest_prefixes_blocks"]) >= 4   # the shared prefix's chain
        assert kv["num_blocks"] == 64 and kv["source"] == "vllm"
    finally:
        source.stop()
        eng.stop()
