"""llama.cpp's ``llama-server`` as a stand-in: ``/metrics`` written exactly as
``server_task_result_metrics::to_metrics`` (``tools/server/server-task.cpp``) writes it (HELP,
TYPE and the unlabelled ``llamacpp:*`` lines, counters then gauges), ``/slots`` as
``server_slot::to_json`` (``next_token`` a one-element list), ``/props``' fields the console
reads, and ``/health`` 503 while "loading". The real server is tested beside it when it is
built (`tests/console/sources/test_llama_server.py`)."""

from __future__ import annotations

import json
from typing import Any

from support.http_standin import StandIn

COUNTERS = [
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "Total time spent processing prompts"),
    ("tokens_predicted_total", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens"),
    ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding "
                       "and multimodal decoding"),
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total",
     "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps"),
]
GAUGES = [
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s"),
    ("requests_processing", "Number of requests processing"),
    ("requests_deferred", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
]


class LlamaServerStub(StandIn):
    def __init__(self, *, slots: int = 4, n_ctx: int = 4096,
                 model_path: str = "/models/SmolLM2-135M-Instruct-Q8_0.gguf") -> None:
        super().__init__(self._route)
        self.loading = False
        self.values: dict[str, float] = {n: 0.0 for n, _ in COUNTERS + GAUGES}
        self.slots: list[dict[str, Any]] = [
            {"id": i, "n_ctx": n_ctx, "speculative": False, "is_processing": False}
            for i in range(slots)]
        self.props = {"default_generation_settings": {"n_ctx": n_ctx}, "total_slots": slots,
                      "model_alias": "", "model_path": model_path}

    def busy(self, slot: int, prompt: int, decoded: int) -> None:
        self.slots[slot].update(is_processing=True, id_task=slot, n_prompt_tokens=prompt,
                                next_token=[{"has_next_token": True, "n_decoded": decoded}])
        self.values["requests_processing"] = sum(bool(s["is_processing"]) for s in self.slots)

    def text(self) -> str:
        out = []
        for kind, items in (("counter", COUNTERS), ("gauge", GAUGES)):
            for name, doc in items:
                out += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}",
                        f"llamacpp:{name} {self.values[name]:g}"]
        return "\n".join(out) + "\n"

    def _route(self, path: str) -> tuple[int, str, bytes]:
        if self.loading:
            body = {"error": {"code": 503, "message": "Loading model",
                              "type": "unavailable_error"}}
            return 503, "application/json", json.dumps(body).encode()
        if path == "/health":
            return 200, "application/json", b'{"status": "ok"}'
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4", self.text().encode()
        if path == "/slots":
            return 200, "application/json", json.dumps(self.slots).encode()
        if path == "/props":
            return 200, "application/json", json.dumps(self.props).encode()
        return 404, "text/plain", b"not found"
