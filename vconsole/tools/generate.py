"""`vconsole generate`: offline batch inference from a JSONL file to a JSONL file.

Each input line is one request; each output line answers the input line with the same index, in
input order. A bad line gets an error line for its index and every other line still runs.
"""

from __future__ import annotations

import json
from typing import Any

from vconsole.engine.core import EngineCore
from vconsole.engine.request import FinishReason, Request
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.sampling import SamplingParams

_SAMPLING_KEYS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int,
                  "seed": int, "ignore_eos": bool}
_KNOWN_KEYS = {"prompt", "prompt_token_ids", "priority", "stop_token_ids", *_SAMPLING_KEYS}


def _error(index: int, reason: str) -> RequestOutput:
    return RequestOutput(request_id=str(index), finished=True,
                         finish_reason=FinishReason.ERROR.value, error=reason, text="")


def parse_line(core: EngineCore, index: int, line: str) -> Request | RequestOutput:
    """One JSONL line → a Request, or a finished error output saying what is wrong."""
    if not line.strip():
        return _error(index, "empty line")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return _error(index, f"invalid JSON: {e.msg} at column {e.colno}")
    if not isinstance(obj, dict):
        return _error(index, "each line must be a JSON object")
    unknown = sorted(set(obj) - _KNOWN_KEYS)
    if unknown:
        return _error(index, f"unknown field(s): {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, kind in _SAMPLING_KEYS.items():
        if key in obj and obj[key] is not None:
            v = obj[key]
            ok = isinstance(v, kind) and not (kind is not bool and isinstance(v, bool))
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v, ok = float(v), True
            if not ok:
                return _error(index, f"{key} must be {kind.__name__}, got {v!r}")
            kwargs[key] = v
    stop = obj.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
        return _error(index, "stop_token_ids must be a list of integers")
    prompt_ids = obj.get("prompt_token_ids")
    if prompt_ids is not None and (not isinstance(prompt_ids, list)
                                   or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in prompt_ids)):
        return _error(index, "prompt_token_ids must be a list of integers")
    try:
        sampling = SamplingParams(stop_token_ids=tuple(stop), **kwargs)
        return core.make_request(str(index), prompt=obj.get("prompt"),
                                 prompt_token_ids=prompt_ids, sampling=sampling,
                                 priority=obj.get("priority", 0))
    except ValueError as e:
        return _error(index, str(e))


def result_line(index: int, out: RequestOutput, token_ids: list[int]) -> dict[str, Any]:
    line: dict[str, Any] = {"index": index, "output_token_ids": token_ids, "text": out.text or "",
                            "finish_reason": out.finish_reason,
                            "num_prompt_tokens": out.num_prompt_tokens,
                            "num_cached_tokens": max(out.num_cached_tokens, 0)}
    if out.error:
        line["error"] = out.error
    return line




