"""HTTP stand-ins for `vconsole bench fleet`: many servers of vLLM's, SGLang's and llama.cpp's
kinds, in a process of their own (so that their cost is not counted as the console's), each
serving its kind's own metric names (and llama.cpp's ``/slots`` and ``/props``) with figures
that move every second.

``python -m vconsole.tools.bench.fleet_standins KIND:PORT ...`` serves them until stdin closes
(the bench holds the pipe), after printing ``ready``.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0]
SGLANG_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGLANG_ITL = [0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
              0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0]
LLAMA_COUNTERS = ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                  "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total",
                  "n_tokens_max")
LLAMA_GAUGES = ("prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing",
                "requests_deferred", "n_busy_slots_per_decode")

Route = Callable[[str], tuple[int, bytes]]


class VllmLike:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.lv = ("Qwen/Qwen2-0.5B", "0")
        self.running = Gauge("vllm:num_requests_running", "running", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=r)
        self.usage = Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=r)
        self.gen = Counter("vllm:generation_tokens", "gen", labels, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "prompt", labels, registry=r)
        self.pre = Counter("vllm:num_preemptions", "pre", labels, registry=r)
        self.q = Counter("vllm:prefix_cache_queries", "q", labels, registry=r)
        self.h = Counter("vllm:prefix_cache_hits", "h", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels,
                              buckets=VLLM_TTFT, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "itl", labels,
                             buckets=VLLM_ITL, registry=r)
        info = Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks",
                                                          "engine"], registry=r)
        info.labels("16", "1000", "0").set(1)

    def tick(self, rng: random.Random) -> None:
        lv = self.lv
        self.running.labels(*lv).set(rng.randint(0, 8))
        self.waiting.labels(*lv).set(rng.randint(0, 4))
        self.usage.labels(*lv).set(rng.random())
        self.gen.labels(*lv).inc(rng.randint(100, 400))
        self.prompt.labels(*lv).inc(rng.randint(100, 400))
        self.q.labels(*lv).inc(100)
        self.h.labels(*lv).inc(40)
        for _ in range(5):
            self.ttft.labels(*lv).observe(rng.uniform(0.02, 0.3))
            self.itl.labels(*lv).observe(rng.uniform(0.01, 0.05))

    def route(self, path: str) -> tuple[int, bytes]:
        return (200, generate_latest(self.registry)) if path == "/metrics" else (404, b"")


class SglangLike:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        sched = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        tok = ["model_name", "engine_type"]
        self.s = ("meta-llama/Llama-3.1-8B-Instruct", "unified", "0", "0")
        self.t = ("meta-llama/Llama-3.1-8B-Instruct", "unified")
        self.running = Gauge("sglang:num_running_reqs", "r", sched, registry=r)
        self.queue = Gauge("sglang:num_queue_reqs", "q", sched, registry=r)
        self.usage = Gauge("sglang:token_usage", "u", sched, registry=r)
        Gauge("sglang:max_total_num_tokens", "m", sched, registry=r).labels(*self.s).set(200_000)
        self.retracted = Counter("sglang:num_retracted_requests", "x", sched, registry=r)
        self.prompt = Counter("sglang:prompt_tokens", "p", [*tok, "is_streaming"], registry=r)
        self.gen = Counter("sglang:generation_tokens", "g", [*tok, "is_streaming"], registry=r)
        self.cached = Counter("sglang:cached_tokens", "c", [*tok, "cache_source"], registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "t", [*tok, "is_streaming"],
                              buckets=SGLANG_TTFT, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "i", tok,
                             buckets=SGLANG_ITL, registry=r)

    def tick(self, rng: random.Random) -> None:
        self.running.labels(*self.s).set(rng.randint(0, 8))
        self.queue.labels(*self.s).set(rng.randint(0, 4))
        self.usage.labels(*self.s).set(rng.random())
        self.prompt.labels(*self.t, "true").inc(rng.randint(100, 400))
        self.gen.labels(*self.t, "true").inc(rng.randint(100, 400))
        self.cached.labels(*self.t, "device").inc(50)
        for _ in range(5):
            self.ttft.labels(*self.t, "true").observe(rng.uniform(0.05, 0.5))
            self.itl.labels(*self.t).observe(rng.uniform(0.005, 0.03))

    def route(self, path: str) -> tuple[int, bytes]:
        return (200, generate_latest(self.registry)) if path == "/metrics" else (404, b"")


class LlamaLike:
    def __init__(self) -> None:
        self.values = {n: 0.0 for n in (*LLAMA_COUNTERS, *LLAMA_GAUGES)}
        self.slots: list[dict[str, Any]] = [{"id": i, "n_ctx": 4096, "is_processing": False}
                                            for i in range(4)]

    def tick(self, rng: random.Random) -> None:
        self.values["tokens_predicted_total"] += rng.randint(20, 80)
        self.values["prompt_tokens_total"] += rng.randint(20, 80)
        busy = rng.randint(0, 4)
        for i, s in enumerate(self.slots):
            s.update(is_processing=i < busy, n_prompt_tokens=300,
                     next_token=[{"n_decoded": rng.randint(0, 500)}])
        self.values["requests_processing"] = busy

    def route(self, path: str) -> tuple[int, bytes]:
        if path == "/metrics":
            lines = []
            for kind, names in (("counter", LLAMA_COUNTERS), ("gauge", LLAMA_GAUGES)):
                for n in names:
                    lines += [f"# HELP llamacpp:{n} {n}", f"# TYPE llamacpp:{n} {kind}",
                              f"llamacpp:{n} {self.values[n]:g}"]
            return 200, ("\n".join(lines) + "\n").encode()
        if path == "/slots":
            return 200, json.dumps(self.slots).encode()
        if path == "/props":
            return 200, json.dumps({"total_slots": 4, "model_path": "/m/SmolLM2.gguf",
                                    "default_generation_settings": {"n_ctx": 4096}}).encode()
        if path == "/health":
            return 200, b'{"status": "ok"}'
        return 404, b""


class StandIn(Protocol):
    def tick(self, rng: random.Random) -> None: ...

    def route(self, path: str) -> tuple[int, bytes]: ...


KINDS: dict[str, Callable[[], StandIn]] = {"vllm": VllmLike, "sglang": SglangLike,
                                           "llama-cpp": LlamaLike}


def serve(route: Route, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, body = route(self.path.split("?")[0])
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer.allow_reuse_address = True
    for attempt in range(10):      # the port may be a client's ephemeral port for a moment
        try:
            server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
            break
        except OSError:
            if attempt == 9:
                raise
            time.sleep(0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str]) -> int:
    servers: list[StandIn] = []
    for spec in argv:
        kind, _, port = spec.partition(":")
        servers.append(KINDS[kind]())
        serve(servers[-1].route, int(port))
    print("ready", flush=True)
    rng = random.Random(0)
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()
    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not stop.wait(1.0):
        for s in servers:
            s.tick(rng)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
