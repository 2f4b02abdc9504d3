"""A step's regime on the record (#44): whether the forward ran as one native call
(`vconsole.engine.worker.native_decode`) or through the Python layers, per step in `StepStats`
and the request trace, and the widest native step in the trace header. The what-if's step-cost
model fits the two apart (`vconsole.whatif.cost_model`). A real engine core on the CPU."""

from __future__ import annotations

import pytest

from vconsole.engine.core import EngineCore
from vconsole.engine.process.request_trace import trace_header
from vconsole.engine.worker import native_decode
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import StepStats
from vconsole.wire.sampling import SamplingParams


def steps_of(core: EngineCore, num_requests: int) -> list[StepStats]:
    for i in range(num_requests):
        core.add_request(core.make_request(f"r{i}", prompt_token_ids=[5 + i] * 12,
                                           sampling=SamplingParams(max_tokens=5,
                                                                   ignore_eos=True)))
    steps = []
    while core.has_unfinished_requests():
        core.step()
        assert core.last_step is not None
        steps.append(core.last_step)
    return steps


def config(**kw: object) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", num_kv_blocks=32, block_size=8,
                        max_num_batched_tokens=64, **kw)  # type: ignore[arg-type]


def test_small_decode_steps_are_native_and_prefill_steps_are_not() -> None:
    core = EngineCore(config())
    try:
        header = trace_header(core.config, core.model_info())
        fused = core.runner.fused_decoder
        if core.runner.native_decode_rows == 0:      # the extension could not be built here
            pytest.skip(f"no native decode step: {fused.native_reason if fused else 'no fused'}")
        assert header.native_decode_rows == native_decode.MAX_ROWS
        # The header's block bytes: B x per token + per block, the runner's own block size.
        per_token, per_block = header.kv_block_bytes_by_dtype["auto"]
        assert core.runner.kv_cache_bytes_per_block(8) == 8 * per_token + per_block
        assert core.runner.kv_pool_bytes == 32 * (8 * per_token + per_block)
        steps = steps_of(core, 2)
    finally:
        core.close()
    prefill = [s for s in steps if s.num_prefill_tokens]
    decode = [s for s in steps if not s.num_prefill_tokens and s.num_decode_tokens]
    assert prefill and decode
    assert not any(s.native for s in prefill)
    assert all(s.native for s in decode)


@pytest.mark.parametrize("why", ["python", "int8"])
def test_an_engine_without_the_native_step_records_none(why: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if why == "python":
        monkeypatch.setenv(native_decode.DECODE_STEP_ENV, "python")
    core = EngineCore(config(**({"kv_cache_dtype": "int8"} if why == "int8" else {})))
    try:
        header = trace_header(core.config, core.model_info())
        assert header.native_decode_rows == 0
        name = core.runner.kv_cache_dtype if why == "int8" else "auto"
        per_token, per_block = header.kv_block_bytes_by_dtype[name]
        assert core.runner.kv_cache_bytes_per_block(8) == 8 * per_token + per_block
        steps = steps_of(core, 2)
    finally:
        core.close()
    assert any(s.num_decode_tokens and not s.num_prefill_tokens for s in steps)
    assert not any(s.native for s in steps)
