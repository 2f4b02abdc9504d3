"""OpenAIServingModels: ``GET /v1/models``, the one model this server serves, in OpenAI's list
shape with vLLM's extras (``root``: the model directory, ``max_model_len``, ``vocab_size``)."""

from __future__ import annotations

from typing import Any

from vconsole.entrypoints.openai.serving_base import ServingEndpoint


class OpenAIServingModels(ServingEndpoint):
    def models(self) -> dict[str, Any]:
        s = self.serving
        return {"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": s.created,
            "owned_by": "vconsole", "root": s.engine.info.get("model_path", s.model_name),
            "parent": None, "max_model_len": s.max_model_len,
            "vocab_size": s.engine.info.get("vocab_size")}]}
