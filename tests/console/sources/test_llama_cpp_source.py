"""llama.cpp's ``llama-server`` (a stand-in writing its exact ``/metrics`` text, ``/slots`` and
``/props``) read into the console's messages: KV use estimated from the slots and marked so,
no latency invented, ``starting`` while ``/health`` says 503."""

from __future__ import annotations

from support.llama_cpp_stub import LlamaServerStub
from vconsole.console.sources.fleet.sources import ScrapeSource
from vconsole.console.sources.fleet.targets import make_target
from vconsole.console.sources.llama_cpp import kv_estimate, slot_tokens
from vconsole.console.state import ConsoleState


def test_kv_use_is_the_processing_slots_tokens_over_their_context():
    stub = LlamaServerStub(slots=4, n_ctx=1000)
    stub.busy(0, prompt=300, decoded=50)
    stub.busy(2, prompt=100, decoded=150)
    usage, cap = kv_estimate(stub.slots, stub.props)
    assert cap == 4000 and usage == (350 + 250) / 4000
    assert slot_tokens({"is_processing": True, "n_prompt_tokens": 5,
                        "next_token": {"n_decoded": 2}}) == 7    # the README's object form


def test_a_scrape_gives_the_servers_counters_and_the_estimate_marked_estimated():
    stub = LlamaServerStub(slots=2, n_ctx=2048)
    stub.busy(1, prompt=500, decoded=12)
    stub.values.update({"tokens_predicted_total": 1234, "prompt_tokens_total": 800,
                        "prompt_tokens_cached_total": 200, "requests_deferred": 3})
    url = stub.serve()
    state = ConsoleState()
    src = ScrapeSource(make_target("llama-cpp", url, name="llama"))
    try:
        assert src.scrape_once(state), src.problem
    finally:
        stub.close()
    eng = state.engines["llama/0"]
    kv, sched, health = eng.latest["kv"], eng.latest["sched"], eng.latest["health"]
    assert kv["usage"] == 512 / 4096 and kv["usage_estimated"] is True
    assert (sched["num_running"], sched["num_waiting"]) == (1, 3)
    assert sched["num_generation_tokens_total"] == 1234
    assert kv["prefix_hit_rate"] == 200 / 1000
    assert health["model"] == "SmolLM2-135M-Instruct-Q8_0.gguf"
    assert eng.latest["latency"]["overall"]["histograms"] == {}     # none: never zeros


def test_a_loading_server_is_starting_and_says_why():
    stub = LlamaServerStub()
    stub.loading = True
    url = stub.serve()
    src = ScrapeSource(make_target("llama-cpp", url, name="llama"))
    try:
        assert not src.scrape_once(ConsoleState())
    finally:
        stub.close()
    assert src.starting and "503, loading the model" in (src.problem or "")
