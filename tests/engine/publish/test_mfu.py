"""--enable-mfu-metrics: vLLM's analytic FLOPs and bytes per step (vllm/v1/metrics/perf.py),
checked against a calculation by hand for the tiny model."""

from __future__ import annotations

import pytest

from vconsole.engine.publish.device_peak import Peaks, measure_peaks
from vconsole.engine.publish.mfu import ModelDims, PerfCounters, step_perf
from vconsole.shared.stats import StepStats

# The tiny model (vconsole.engine.worker.tiny_model.TINY_LLAMA) in float32 with a float32 pool.
TINY = ModelDims(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                 intermediate_size=688, vocab_size=259, activation_bytes=4, weight_bytes=4,
                 cache_bytes=4)


def batch(rows: list[tuple[int, int]]) -> StepStats:
    """A step of rows (start, n), its aggregates as the scheduler fills them."""
    prefill = [(s, n) for s, n in rows if n > 1]
    return StepStats(
        schedule_ns=0, execute_ns=0, update_ns=0, total_ns=0,
        num_prefill_tokens=sum(n for _, n in prefill),
        num_decode_tokens=sum(n for _, n in rows if n == 1), num_reqs=len(rows),
        num_context_tokens=sum(s + n for s, n in rows),
        prefill_attention=sum(n * (s + n) for s, n in prefill),
        num_prefill_reqs=len(prefill), prefill_context_tokens=sum(s + n for s, n in prefill))


def test_a_prefill_and_a_decode_row_cost_what_vllms_formulas_give_by_hand() -> None:
    # One prompt of 10 (start 0) and one decode at position 20: T = 11, context 10 and 21,
    # sum of n x c = 10 x 10 + 21 = 121, logits for 2 rows. L=4 D=256 q=4 kv=2 d=64 DI=688 V=259.
    flops = (11_534_336      # qkv_proj   2·11·256·(4+2·2)·64·4
             + 5_767_168     # out_proj   2·11·256·4·64·4
             + 495_616       # attn_qk + attn_av   2 · 2·4·121·64·4
             + 46_497_792    # dense_ffn  2·256·3·688·11·4
             + 265_216)      # unembed    2·2·256·259
    read = (45_056           # qkv_input  11·256·4·4
            + 2_097_152      # qkv_weight 256·8·64·4·4
            + 81_920         # attn_input, prefill  (10·4 + 2·10·2)·64·4·4
            + 90_112         # attn_input, decode   1·4·64·4·4 + 2·21·2·64·4·4
            + 45_056         # out_input  11·4·64·4·4
            + 1_048_576      # out_weight 4·64·256·4·4
            + 45_056         # ffn up/gate input  11·256·4·4
            + 5_636_096      # ffn up/gate weights  2·256·688·4·4
            + 242_176        # ffn silu input  2·11·688·4·4
            + 121_088        # ffn down input  11·688·4·4
            + 2_818_048      # ffn down weights  256·688·4·4
            + 2_048          # unembed input  2·256·4
            + 265_216)       # unembed weight  256·259·4
    write = (90_112          # qkv_output  11·8·64·4·4
             + 45_056        # kv_cache    2·11·2·64·4·4
             + 45_056        # out_output  11·256·4·4
             + 242_176       # ffn up/gate output  2·11·688·4·4
             + 121_088       # ffn silu output  11·688·4·4
             + 45_056        # ffn down output  11·256·4·4
             + 2_072)        # unembed output  2·259·4
    assert step_perf(TINY, batch([(0, 10), (20, 1)])) == (flops, read, write)
    assert (flops, read, write) == (64_560_128, 12_537_600, 590_616)


def test_a_step_without_tokens_counts_nothing() -> None:
    assert step_perf(TINY, batch([])) == (0, 0, 0)


def test_the_counters_are_cumulative_over_steps() -> None:
    counters = PerfCounters(TINY)
    steps = [batch([(0, 10)]), batch([(10, 1)]), batch([(11, 1), (0, 4)])]
    counters.add(steps[:2])
    body = counters.add(steps[2:])
    sums = [sum(step_perf(TINY, s)[i] for s in steps) for i in range(3)]
    last = step_perf(TINY, steps[2])
    assert body == {"flops_total": sums[0], "read_bytes_total": sums[1],
                    "write_bytes_total": sums[2], "flops": last[0], "read_bytes": last[1],
                    "write_bytes": last[2]}
    assert counters.add([])["flops"] == 0


def test_dims_come_from_the_cores_model_info_or_not_at_all() -> None:
    info = {"dims": {k: getattr(TINY, k) for k in TINY.__dataclass_fields__}}
    assert ModelDims.of(info) == TINY
    assert ModelDims.of({}) is None
    assert ModelDims.of({"dims": {"num_layers": 4}}) is None


@pytest.mark.parametrize("weight_bytes", [1, 4])
def test_int8_weights_read_a_quarter_of_the_weight_bytes(weight_bytes: int) -> None:
    dims = ModelDims(**{**{k: getattr(TINY, k) for k in TINY.__dataclass_fields__},
                        "weight_bytes": weight_bytes})
    step = batch([(5, 1)])
    weights = (256 * 8 * 64 + 4 * 64 * 256 + 3 * 256 * 688) * 4 + 256 * 259   # elements
    assert step_perf(dims, step)[1] - step_perf(
        ModelDims(**{**dims.__dict__, "weight_bytes": 0}), step)[1] == weights * weight_bytes


def test_a_cpu_engines_counters_carry_this_machines_peaks_measured_once() -> None:
    calls = []

    def measure() -> Peaks:
        calls.append(1)
        return Peaks(flops_per_s=1e11, bytes_per_s=1e10)

    cpu = PerfCounters(ModelDims(**{**TINY.__dict__, "cpu": True}), measure)
    first, second = cpu.add([batch([(0, 10)])]), cpu.add([])
    assert calls == [1]
    assert first["peak_flops_per_s"] == second["peak_flops_per_s"] == 1e11
    assert second["peak_bytes_per_s"] == 1e10
    gpu = PerfCounters(TINY, measure)          # not a CPU engine: no peak of ours applies
    assert "peak_flops_per_s" not in gpu.add([batch([(0, 10)])]) and calls == [1]


def test_the_measured_peaks_are_real_rates() -> None:
    peaks = measure_peaks(repeats=1)
    assert peaks.flops_per_s > 1e8 and peaks.bytes_per_s > 1e7
