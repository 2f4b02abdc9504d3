"""10,000 requests at once from four clients, against one engine process.

The clients speak the wire protocol directly (`vconsole.wire.protocol`, as PROTOCOL.md
describes it) rather than through `EngineClient`: a library client routes outputs only to
requests it still waits for, so a second final output, or an output for a request nobody
submitted, would never be seen. Here every output message is counted. The specification:

- every request gets exactly one final output (``length``, with its two tokens), and no client
  receives an output for a request it did not submit, nor any ``error``;
- the tokens the clients received equal the engine's own counters on the telemetry ``sched``
  topic (``num_generation_tokens_total``, ``num_prompt_tokens_total``), which rose by exactly
  that much during the run;
- the scheduler drains to zero waiting and running.

The engine's peak resident memory during the run is measured (psutil, sampled from a thread),
printed and recorded (``record_property`` and ``load.json`` under the test's tmp_path); only a
generous sanity cap is asserted, since it depends on the machine and the allocator.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import pytest
import zmq

from support.live_engine import RssSampler, Telemetry, ipc_endpoints
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.wire import protocol

pytestmark = [pytest.mark.proc, pytest.mark.slow]

CLIENTS = 4
PER_CLIENT = 2_500
MAX_TOKENS = 2
ENGINE_ARGS = ["--model", "tiny", "--no-supervisor", "--num-kv-blocks", "1024", "--block-size",
               "8", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048"]
RUN_TIMEOUT_S = 180.0
PEAK_RSS_ABOVE_BASELINE_CAP = 1 << 30  # a sanity cap, not a budget: 10,000 queued requests
                                       # cost tens of MiB


class WireClient(threading.Thread):
    """One client: submits its prompts at once, then counts every output message it receives,
    per request id. Told to `stop` (once the engine has drained), it submits one last request,
    the *fence*, and reads until the fence's final output: the engine sends a client's outputs
    in order on one connection, so anything it sent for the earlier requests (a late duplicate,
    a stray) has been counted by then."""

    def __init__(self, endpoints: dict[str, str], name: str, prompts: list[list[int]]) -> None:
        super().__init__(name=name, daemon=True)
        self.endpoints = endpoints
        self.identity = name.encode()
        self.prompts = {f"{name}-{i}": ids for i, ids in enumerate(prompts)}
        self.finals: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.reasons: dict[str, str | None] = {}
        self.num_output_tokens: dict[str, int] = {}
        self.strays: list[object] = []
        self.errors: list[dict] = []
        self.failure: BaseException | None = None
        self.all_final = threading.Event()
        self.stop = threading.Event()
        self.fence = f"{name}-fence"
        self.fenced = False

    def run(self) -> None:
        ctx = zmq.Context()
        inp, out = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for s in (inp, out):
                s.setsockopt(zmq.IDENTITY, self.identity)
                s.setsockopt(zmq.LINGER, 0)
            out.setsockopt(zmq.RCVHWM, 0)  # never let the engine take us for a stuck reader
            out.connect(self.endpoints["output"])
            inp.connect(self.endpoints["input"])
            inp.send_multipart(protocol.encode_hello())
            while True:
                assert out.poll(30_000), "no ready"
                if protocol.decode(out.recv_multipart())["type"] == protocol.READY:
                    break
            sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
            for n, (rid, ids) in enumerate(self.prompts.items()):
                inp.send_multipart(protocol.encode_add(rid, prompt_token_ids=ids,
                                                       sampling=sampling))
                if n % 100 == 0:
                    self._read(out, 0)
            while not self.stop.is_set():
                self._read(out, 50)
            inp.send_multipart(protocol.encode_add(self.fence, prompt_token_ids=[5, 6],
                                                   sampling={"max_tokens": 1}))
            deadline = time.monotonic() + 30
            while not self.fenced and time.monotonic() < deadline:
                self._read(out, 50)
        except BaseException as e:
            self.failure = e
            self.all_final.set()
        finally:
            inp.close(0)
            out.close(0)
            ctx.term()

    def _read(self, sock: zmq.Socket, timeout_ms: int) -> None:
        if not sock.poll(timeout_ms):
            return
        while sock.poll(0):
            header = protocol.decode(sock.recv_multipart())
            if header["type"] == protocol.ERROR:
                self.errors.append(header)
            elif header["type"] == protocol.OUTPUTS:
                for o in protocol.parse_outputs(header):
                    if o.request_id == self.fence:
                        self.fenced = o.finished
                        continue
                    if o.request_id not in self.prompts:
                        self.strays.append(o)
                        continue
                    self.tokens[o.request_id] += len(o.new_token_ids)
                    if o.finished:
                        self.finals[o.request_id] += 1
                        self.reasons[o.request_id] = o.finish_reason
                        self.num_output_tokens[o.request_id] = o.num_output_tokens
                if len(self.finals) == len(self.prompts):
                    self.all_final.set()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("load")
    with EngineProcess(ENGINE_ARGS, endpoints=ipc_endpoints(d), log_path=d / "engine.log") as e:
        yield e


def test_ten_thousand_requests_from_four_clients_each_finish_exactly_once(
        engine, tmp_path, record_property):
    rng = random.Random(4)
    telemetry = Telemetry(engine.endpoints["telemetry"])
    try:
        before = telemetry.wait_for("sched", lambda s: s["num_running"] == 0, timeout_s=15,
                                    since=time.monotonic())
        clients = [WireClient(engine.endpoints, f"load{c}",
                              [[rng.randrange(3, 259) for _ in range(rng.randint(2, 5))]
                               for _ in range(PER_CLIENT)]) for c in range(CLIENTS)]
        with RssSampler(engine.pid) as rss:
            baseline = rss.rss()
            t0 = time.monotonic()
            for c in clients:
                c.start()
            deadline = t0 + RUN_TIMEOUT_S
            for c in clients:
                assert c.all_final.wait(max(0.0, deadline - time.monotonic())), \
                    f"{c.name}: {len(c.finals)} of {PER_CLIENT} finished in {RUN_TIMEOUT_S} s"
            elapsed = time.monotonic() - t0
            after = telemetry.wait_for(
                "sched", lambda s: s["num_finished_total"] >= before["num_finished_total"]
                + CLIENTS * PER_CLIENT and s["num_waiting"] == 0 and s["num_running"] == 0,
                since=t0, timeout_s=30)
            for c in clients:
                c.stop.set()
            for c in clients:
                c.join(60)
    finally:
        telemetry.close()

    for c in clients:
        assert c.failure is None, (c.name, c.failure)
        assert c.fenced, f"{c.name}: no final output for its fence request"
        assert not c.errors, (c.name, c.errors[:3])
        assert not c.strays, (c.name, c.strays[:3])
        assert set(c.finals) == set(c.prompts) and set(c.finals.values()) == {1}, c.name
        assert set(c.reasons.values()) == {"length"}, c.name
        assert set(c.tokens.values()) == {MAX_TOKENS}, c.name
        assert set(c.num_output_tokens.values()) == {MAX_TOKENS}, c.name

    received = sum(sum(c.tokens.values()) for c in clients)
    prompt_tokens = sum(len(ids) for c in clients for ids in c.prompts.values())
    generated = after["num_generation_tokens_total"] - before["num_generation_tokens_total"]
    prompted = after["num_prompt_tokens_total"] - before["num_prompt_tokens_total"]
    assert received == CLIENTS * PER_CLIENT * MAX_TOKENS == generated
    assert prompted == prompt_tokens

    figures = {"requests": CLIENTS * PER_CLIENT, "clients": CLIENTS,
               "generation_tokens": generated, "prompt_tokens": prompted,
               "run_s": round(elapsed, 2), "requests_per_s": round(CLIENTS * PER_CLIENT / elapsed),
               "engine_rss_baseline_bytes": baseline, "engine_rss_peak_bytes": rss.peak,
               "rss_samples": len(rss.samples)}
    print("load:", json.dumps(figures))
    (tmp_path / "load.json").write_text(json.dumps(figures, indent=2))
    for k, v in figures.items():
        record_property(k, v)
    assert rss.samples and rss.peak - baseline < PEAK_RSS_ABOVE_BASELINE_CAP, figures


def test_a_started_engine_is_not_started_twice(engine):
    """`with EngineProcess(args).start(timeout_s=...)` enters the engine it started, and a
    second start is refused: it used to start a second engine and leave the first running,
    unwatched (three benches did this for every recording)."""
    pid = engine.pid
    assert engine.__enter__() is engine and engine.pid == pid
    with pytest.raises(RuntimeError, match="started already"):
        engine.start()
    assert engine.pid == pid and engine.child.poll() is None
