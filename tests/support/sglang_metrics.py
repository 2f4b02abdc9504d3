"""An SGLang server's ``/metrics`` (``--enable-metrics``) with exactly SGLang's names, types,
label sets and default buckets, as ``python/sglang/srt/observability/metrics_collector.py``
(sglang 0.5.23) defines them: the scheduler's gauges labelled ``model_name``, ``engine_type``,
``tp_rank``, ``pp_rank``; the tokenizer's counters and histograms labelled ``model_name``,
``engine_type`` and ``is_streaming`` (``cache_source`` for cached tokens). SGLang's own
collector cannot run here (it needs the whole server), so this builds the same series with
prometheus_client, the library SGLang uses."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from support.http_standin import StandIn

TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0]
QUEUE_BUCKETS = [0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30,
                 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000,
                 1200, 1400, 1600, 1800, 2000, 2500, 3000]
SCHED = ["model_name", "engine_type", "tp_rank", "pp_rank"]
TOK = ["model_name", "engine_type"]


class SglangMetrics(StandIn):
    def __init__(self, *, model: str = "meta-llama/Llama-3.1-8B-Instruct",
                 max_total_num_tokens: int = 200_000) -> None:
        super().__init__(self._route)
        r = self.registry = CollectorRegistry()
        self.model = model
        self.sched = {"model_name": model, "engine_type": "unified", "tp_rank": "0",
                      "pp_rank": "0"}
        self.tok = {"model_name": model, "engine_type": "unified"}

        def g(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, SCHED, registry=r)
        self.running = g("sglang:num_running_reqs", "The number of running requests.")
        self.queue = g("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.gen_throughput = g("sglang:gen_throughput", "The generation throughput (token/s).")
        self.cache_hit_rate = g("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.token_usage = g("sglang:token_usage", "The token usage.")
        self.used_tokens = g("sglang:num_used_tokens", "The number of used tokens.")
        self.max_tokens = g("sglang:max_total_num_tokens",
                            "Maximum total number of tokens in the KV cache pool.")
        self.retracted = Counter("sglang:num_retracted_requests",
                                 "Total number of retracted requests.", SCHED, registry=r)
        self.queue_time = Histogram("sglang:queue_time_seconds",
                                    "Histogram of queueing time in seconds.", SCHED,
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                              [*TOK, "is_streaming"], registry=r)
        self.generation = Counter("sglang:generation_tokens",
                                  "Number of generation tokens processed.",
                                  [*TOK, "is_streaming"], registry=r)
        self.cached = Counter("sglang:cached_tokens",
                              "Number of cached prompt tokens by source (device/host/storage).",
                              [*TOK, "cache_source"], registry=r)
        self.requests = Counter("sglang:num_requests", "Number of requests processed.",
                                [*TOK, "is_streaming"], registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              [*TOK, "is_streaming"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", TOK,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds",
                             [*TOK, "is_streaming"], buckets=E2E_BUCKETS, registry=r)
        self.max_tokens.labels(**self.sched).set(max_total_num_tokens)
        self.max_total_num_tokens = max_total_num_tokens

    def step(self, *, running: int, waiting: int, used_tokens: int, prompt: int = 0,
             cached: int = 0, generation: int = 0, finished: int = 0, retracted: int = 0,
             ttft: float = 0.3, itl: float = 0.012, streaming: bool = True) -> None:
        s, t = self.sched, self.tok
        stream = {**t, "is_streaming": "true" if streaming else "false"}
        self.running.labels(**s).set(running)
        self.queue.labels(**s).set(waiting)
        self.used_tokens.labels(**s).set(used_tokens)
        self.token_usage.labels(**s).set(used_tokens / self.max_total_num_tokens)
        self.retracted.labels(**s).inc(retracted)
        self.prompt.labels(**stream).inc(prompt)
        self.generation.labels(**stream).inc(generation)
        if cached:
            self.cached.labels(**t, cache_source="device").inc(cached)
        for _ in range(finished):
            self.requests.labels(**stream).inc()
            self.ttft.labels(**stream).observe(ttft)
            self.e2e.labels(**stream).observe(ttft + 10 * itl)
            self.queue_time.labels(**s).observe(ttft / 3)
        for _ in range(generation):
            self.itl.labels(**t).observe(itl)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def _route(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4", self.text().encode()
        if path == "/health":
            return 200, "text/plain", b""
        return 404, "text/plain", b"not found"
