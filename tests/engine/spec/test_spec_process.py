"""A real engine process started with ``--speculative-config``: clients get the tokens an
in-process engine without speculation gives, ``/metrics`` carries vLLM's spec-decode counters
equal to the telemetry's, and the hot key pauses speculation through the control channel."""

from __future__ import annotations

import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.live_engine import Telemetry, reference_outputs
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.wire.control_client import ControlClient

pytestmark = [pytest.mark.proc, pytest.mark.slow]

SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}')
_rng = random.Random(7)
_BASE = [_rng.randrange(3, 250) for _ in range(24)]
WORK = [(_BASE + _BASE[:12], 16), (_BASE[5:] * 2, 16), ([_rng.randrange(3, 250)
                                                          for _ in range(9)], 12)]


def _spec_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:spec_decode"):
                pos = s.labels.get("position")
                out[s.name + (f"[{pos}]" if pos is not None else "")] = s.value
    return out


def test_a_speculating_engine_serves_greedy_tokens_counts_and_pauses(tmp_path):
    eps = {n: f"ipc://{tmp_path}/{n}" for n in ("input", "output", "telemetry", "control")}
    engine = EngineProcess(["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8",
                            "--metrics-port", "0", "--speculative-config", SPEC,
                            "--set", "telemetry_hz=20", "--set", "heartbeat_interval_s=0.25"],
                           endpoints=eps, log_path=tmp_path / "engine.log").start()
    telemetry = Telemetry(eps["telemetry"])
    try:
        expected = reference_outputs(WORK)
        with EngineClient(eps["input"], eps["output"]).connect() as c:
            ids = [c.submit(prompt_token_ids=p, max_tokens=n) for p, n in WORK]
            done = c.gather(ids, timeout_s=120)
        assert [done[i].output_token_ids for i in ids] == expected
        sched = telemetry.wait_for("sched", lambda p: p["num_running"] == 0
                                   and (p.get("spec_decode") or {}).get("num_drafts", 0) > 0)
        spec = sched["spec_decode"]
        assert spec["enabled"] and spec["num_speculative_tokens"] == 3
        got = _spec_counters(engine.ready["metrics"])
        assert got["vllm:spec_decode_num_drafts_total"] == spec["num_drafts"]
        assert got["vllm:spec_decode_num_draft_tokens_total"] == spec["num_draft_tokens"]
        assert got["vllm:spec_decode_num_accepted_tokens_total"] == spec["num_accepted_tokens"]
        assert [got[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"]
                for i in range(3)] == spec["accepted_per_pos"]

        ctl = ControlClient(eps["control"], timeout_s=10, key=engine.control_key())
        reply = ctl.set_config({"speculative_decoding": "false"})
        assert reply["ok"] and reply["applied"] == {"speculative_decoding": False}
        telemetry.wait_for("sched", lambda p: p["spec_decode"]["enabled"] is False)
        refused = ctl.set_config({"speculative_config": None})
        assert not refused["ok"] and refused["restart_required"] == ["speculative_config"]
        with EngineClient(eps["input"], eps["output"]).connect() as c:
            rid = c.submit(prompt_token_ids=WORK[0][0], max_tokens=16)
            assert c.gather([rid], timeout_s=120)[rid].output_token_ids == expected[0]
        after = telemetry.wait_for("sched", lambda p: p["num_running"] == 0
                                   and p["num_finished_total"] >= 4)
        assert after["spec_decode"]["num_drafts"] == spec["num_drafts"]   # paused: none
    finally:
        telemetry.close()
        engine.stop()
