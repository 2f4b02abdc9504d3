"""A fleet target's ``kv_events``: a vLLM-kind target (our engine's own /metrics, which has
vLLM's names, and its KV events in vLLM's format) shows the prefix cache's contents, as
``attach --vllm --kv-events`` does; an endpoint it cannot use is one line, and the metrics go
on."""

from __future__ import annotations

import time

import pytest

from vconsole.console.sources.fleet.sources import ScrapeSource
from vconsole.console.sources.fleet.targets import TargetError, make_target
from vconsole.console.state import ConsoleState
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess

pytestmark = [pytest.mark.proc, pytest.mark.slow]


def test_a_targets_kv_events_fill_the_prefix_cache(tmp_path):
    eng = EngineProcess(["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8",
                         "--metrics-port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:*"],
                        log_path=tmp_path / "engine.log").start()
    target = make_target("vllm", eng.ready["metrics"], name="ours-as-vllm",
                         kv_events=eng.ready["kv_events"]["endpoint"])
    source = ScrapeSource(target, interval_s=0.3)
    state = ConsoleState()
    try:
        source.start(state)
        deadline = time.monotonic() + 60
        while source.feed is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert source.feed is not None, source.kv_events_problem
        with EngineClient(eng.endpoints["input"], eng.endpoints["output"]) as client:
            poke = 0
            while source.feed.summary(0) is None:      # until the feed's SUB has joined
                assert time.monotonic() < deadline, "the feed never heard a KV event"
                poke += 1
                client.gather([client.submit(prompt_token_ids=[140 + poke % 100] * 9,
                                             max_tokens=1)], timeout_s=60)
            prefix = list(range(100, 132))
            client.gather([client.submit(prompt_token_ids=[*prefix, 3 + i], max_tokens=4,
                                         ignore_eos=True) for i in range(4)], timeout_s=120)
        pc = None
        while time.monotonic() < deadline:
            with state.lock:
                kv = state.engines["ours-as-vllm/0"].latest.get("kv", {})
                pc = kv.get("prefix_cache")
            if pc and pc["cached_blocks"] >= 4:
                break
            time.sleep(0.2)
        assert pc is not None and pc["cached_blocks"] >= 4 and pc["block_size"] == 8
    finally:
        source.stop()
        eng.stop()


def test_a_kv_events_endpoint_without_a_port_is_refused_up_front():
    with pytest.raises(TargetError, match="kv_events 'tcp://nowhere'"):
        make_target("sglang", "http://127.0.0.1:42199", kv_events="tcp://nowhere")
