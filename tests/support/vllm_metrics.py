"""A vLLM server's ``/metrics`` as vLLM itself would expose it, for the vLLM console source.

`VllmMetrics` builds the series with prometheus_client exactly as ``PrometheusStatLogger`` in
``vllm/v1/metrics/loggers.py`` constructs them (vLLM 0.2x–0.33, "M4" in our notes: names,
types, help strings, the ``model_name``/``engine`` labels, ``reason``/``sleep_state``/
``finished_reason`` labels, ``vllm:cache_config_info`` labelled by ``engine`` without
``model_name``, and the histogram buckets), one labelled child per engine, and serves
``generate_latest`` over HTTP on 127.0.0.1 (with ``dev_mode``, also the dev routes
``POST /reset_prefix_cache``, ``/sleep``, ``/wake_up`` and ``GET /is_sleeping``, as
``VLLM_SERVER_DEV_MODE=1``; no profiler routes). ``legacy=True`` uses the older names a scraper
still meets (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``,
``vllm:time_per_output_token_seconds``) and leaves out the newer series.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
LABELS = ["model_name", "engine"]


class VllmMetrics:
    def __init__(self, engines: int = 2, *, model: str = "Qwen/Qwen2-0.5B",
                 legacy: bool = False, num_gpu_blocks: int = 1000, block_size: int = 16,
                 cache_dtype: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.engines = [str(i) for i in range(engines)]
        self.model = model
        self.legacy = legacy
        r = self.registry
        self.running = Gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.", LABELS,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.", LABELS, registry=r)
        usage_name = "vllm:gpu_cache_usage_perc" if legacy else "vllm:kv_cache_usage_perc"
        self.usage = Gauge(usage_name, "KV-cache usage. 1 means 100 percent usage.", LABELS,
                           registry=r)
        self.preemptions = Counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.", LABELS,
                                   registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                              LABELS, registry=r)
        self.generation = Counter("vllm:generation_tokens",
                                  "Number of generation tokens processed.", LABELS, registry=r)
        self.success = Counter("vllm:request_success",
                               "Count of successfully processed requests.",
                               [*LABELS, "finished_reason"], registry=r)
        prefix = "vllm:gpu_prefix_cache" if legacy else "vllm:prefix_cache"
        self.queries = Counter(f"{prefix}_queries",
                               "Prefix cache queries, in terms of number of queried tokens.",
                               LABELS, registry=r)
        self.hits = Counter(f"{prefix}_hits",
                            "Prefix cache hits, in terms of number of cached tokens.", LABELS,
                            registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", LABELS,
                              buckets=TTFT_BUCKETS, registry=r)
        itl_name = ("vllm:time_per_output_token_seconds" if legacy
                    else "vllm:inter_token_latency_seconds")
        self.itl = Histogram(itl_name, "Histogram of inter-token latency in seconds.", LABELS,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LABELS,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", LABELS,
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.iteration = Histogram("vllm:iteration_tokens_total",
                                   "Histogram of number of tokens per engine_step.", LABELS,
                                   buckets=ITERATION_BUCKETS, registry=r)
        if not legacy:
            self.by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                                   "Number of waiting requests by reason.",
                                   [*LABELS, "reason"], registry=r)
            self.sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state",
                               [*LABELS, "sleep_state"], registry=r)
        dtype_label = {"cache_dtype": cache_dtype} if cache_dtype is not None else {}
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["block_size", "gpu_memory_utilization", "enable_prefix_caching",
                      "num_gpu_blocks", *dtype_label, "engine"], registry=r)
        for e in self.engines:
            info.labels(block_size=str(block_size), gpu_memory_utilization="0.9",
                        enable_prefix_caching="True", num_gpu_blocks=str(num_gpu_blocks),
                        **dtype_label, engine=e).set(1)
            for reason in ("stop", "length", "abort", "error", "repetition"):
                self.success.labels(model, e, reason)
            if not legacy:
                self.sleep.labels(model, e, "awake").set(1)
                self.sleep.labels(model, e, "weights_offloaded").set(0)
                self.sleep.labels(model, e, "discard_all").set(0)
        self._server: ThreadingHTTPServer | None = None
        self.dev_mode = False        # answer vLLM's dev routes (VLLM_SERVER_DEV_MODE=1)
        self.posts: list[str] = []   # the POSTs the server answered

    def step(self, engine: str, *, running: int, waiting: int, usage: float,
             prompt: int = 0, generation: int = 0, finished: int = 0, steps: int = 0,
             ttft: float = 0.05, itl: float = 0.02) -> None:
        """One engine's state now, and what happened since the last call."""
        m = self.model
        self.running.labels(m, engine).set(running)
        self.waiting.labels(m, engine).set(waiting)
        self.usage.labels(m, engine).set(usage)
        if not self.legacy:
            self.by_reason.labels(m, engine, "capacity").set(waiting)
            self.by_reason.labels(m, engine, "deferred").set(0)
        self.prompt.labels(m, engine).inc(prompt)
        self.generation.labels(m, engine).inc(generation)
        self.queries.labels(m, engine).inc(prompt)
        self.hits.labels(m, engine).inc(prompt // 2)
        for _ in range(steps):
            self.iteration.labels(m, engine).observe(max(1, (prompt + generation) // steps))
        for _ in range(finished):
            self.success.labels(m, engine, "length").inc()
            self.ttft.labels(m, engine).observe(ttft)
            self.e2e.labels(m, engine).observe(ttft + 10 * itl)
            self.queue.labels(m, engine).observe(ttft / 2)
        for _ in range(generation):
            self.itl.labels(m, engine).observe(itl)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    # --- an HTTP server, as vLLM's /metrics -----------------------------------------------------

    def serve(self) -> str:
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                route = self.path.split("?")[0]
                if route == "/is_sleeping" and metrics.dev_mode:
                    body = b'{"is_sleeping": false}'
                elif route == "/metrics":
                    body = metrics.text().encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                route = self.path.split("?")[0]
                if not metrics.dev_mode or route not in (
                        "/reset_prefix_cache", "/sleep", "/wake_up"):
                    self.send_error(404)
                    return
                metrics.posts.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
