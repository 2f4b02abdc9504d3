"""OpenAIServingTokenization: ``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them.

``/tokenize`` takes a ``prompt`` (tokenized as a completion's is) or chat ``messages`` (with
``tools``: rendered as a chat request with those tools renders them), never both; it answers
the ids, their count and the context length (and each id's token string when asked).
``/detokenize`` turns ids within the vocabulary back into text.
"""

from __future__ import annotations

from typing import Any

from vconsole.entrypoints.openai.protocol import BadRequest, DetokenizeRequest, TokenizeRequest
from vconsole.entrypoints.openai.serving_base import ServingEndpoint
from vconsole.entrypoints.openai.tools import plan_tools


class OpenAIServingTokenization(ServingEndpoint):
    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        serving = self.serving
        serving.check_model(req.model)
        req.refuse_unknown()
        for i, message in enumerate(req.messages or ()):
            message.refuse_unknown(f"messages.{i}.")
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give exactly one of prompt or messages", param="prompt")
        if req.tools and req.messages is None:
            raise BadRequest("tools are rendered into a chat prompt: send messages with them",
                             param="tools")
        if req.messages is not None:
            # The functions shown as a chat request with these tools shows them.
            plan = plan_tools(req.tools, "required" if req.tools else None, None,
                              auto_enabled=True)
            ids = serving.chat_prompt(req.messages,
                                      add_generation_prompt=req.add_generation_prompt,
                                      tools=plan)
        else:
            ids = serving.tokenizer(req.prompt,
                                    add_special_tokens=req.add_special_tokens).input_ids
        out: dict[str, Any] = {"count": len(ids), "max_model_len": serving.max_model_len,
                               "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = serving.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        serving = self.serving
        serving.check_model(req.model)
        req.refuse_unknown()
        vocab = serving.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}
