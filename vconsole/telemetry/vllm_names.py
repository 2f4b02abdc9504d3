"""vLLM's Prometheus names for the stream's latency series.

Why in the wire package: the engine's exporter (`vconsole.engine.publish.prometheus`) writes
these names and the console's vLLM source (`vconsole.console.sources.vllm_metrics`) reads them
back into the same series; one table keeps the two in step.
"""

# latency series (`vconsole.engine.latency`) -> vLLM histogram name, help
LATENCY_HISTOGRAMS = {
    "ttft_s": ("vllm:time_to_first_token_seconds",
               "Histogram of time to first token in seconds."),
    "itl_s": ("vllm:inter_token_latency_seconds",
              "Histogram of inter-token latency in seconds."),
    "e2e_s": ("vllm:e2e_request_latency_seconds",
              "Histogram of e2e request latency in seconds."),
    "queue_s": ("vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request."),
    "prefill_s": ("vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request."),
    "decode_s": ("vllm:request_decode_time_seconds",
                 "Histogram of time spent in DECODE phase for request."),
    "inference_s": ("vllm:request_inference_time_seconds",
                    "Histogram of time spent in RUNNING phase for request."),
}
