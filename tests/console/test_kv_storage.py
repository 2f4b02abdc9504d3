"""Issue #30: the console says how the KV pool stores tokens — dtype, bytes per token, capacity in
tokens — on the Overview's KV panel and the KV screen, from what the source sends: an engine's
``kv`` message, a vLLM server's ``cache_config_info`` (no bytes per token), or nothing at all (an
engine from before the KV dtypes: nothing is shown, nothing is made up)."""

from __future__ import annotations

import pytest

from support.console_testing import replay_app
from support.synthetic import KV_FORMAT, generate
from support.vllm_metrics import VllmMetrics
from vconsole.console.sources.vllm_metrics import VllmTranslator
from vconsole.console.widgets.panels import kv_storage
from vconsole.telemetry.schema import decode

INT8 = {"cache_dtype": "int8_per_token_head", "bytes_per_token": 1088,
        "capacity_tokens": 4096, "pool_bytes": 4096 * 1088, "num_blocks": 256,
        "block_size": 16}


def test_the_whole_line_when_it_fits():
    assert kv_storage(INT8, 80) == "int8_per_token_head · 1,088 B/token · 4,096 tokens"


def test_a_narrow_panel_gets_the_short_form_and_then_loses_parts_from_the_end():
    assert kv_storage(INT8, 36) == "int8 · 1,088 B/tok · 4,096 tok"
    assert kv_storage(INT8, 20) == "int8 · 1,088 B/tok"
    assert kv_storage(INT8, 5) == "int8"


def test_a_per_channel_pools_staging_is_shown_beside_its_blocks():
    kivi = {**INT8, "cache_dtype": "int4_kivi", "bytes_per_token": 84,
            "staging_bytes": 6_266_880, "staging_blocks": 64}
    assert kv_storage(kivi, 80) == ("int4_kivi · 84 B/token · 4,096 tokens · "
                                    "+ staging 6.0MiB / 64 open")
    assert kv_storage({**kivi, "staging_bytes": 0}, 80) == "int4_kivi · 84 B/token · 4,096 tokens"


def test_an_engine_from_before_the_kv_dtypes_shows_nothing():
    old = {k: v for k, v in INT8.items() if k not in ("cache_dtype", "bytes_per_token",
                                                       "capacity_tokens", "pool_bytes")}
    assert kv_storage(old, 80) == ""
    assert kv_storage(None, 80) == ""


def test_a_source_without_bytes_per_token_says_what_it_knows():
    vllm = {"cache_dtype": "fp8", "bytes_per_token": None, "capacity_tokens": None,
            "num_blocks": 1000, "block_size": 16}
    assert kv_storage(vllm, 80) == "fp8 · 16,000 tokens"     # capacity from blocks x size


def test_a_vllm_servers_cache_dtype_label_reaches_the_kv_body():
    tr = VllmTranslator("vllm@test")
    frames = tr.translate(VllmMetrics(engines=1, cache_dtype="fp8").text(), now=100.0)
    kv = next(m.payload for m in map(decode, frames) if m.topic == "kv")
    assert (kv["cache_dtype"], kv["bytes_per_token"], kv["capacity_tokens"]) == (
        "fp8", None, 1000 * 16)
    frames = VllmTranslator("vllm@test").translate(VllmMetrics(engines=1).text(), now=100.0)
    kv = next(m.payload for m in map(decode, frames) if m.topic == "kv")
    assert kv["cache_dtype"] is None                         # a label the server did not send


@pytest.mark.slow
@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_the_overview_and_the_kv_screen_name_the_pools_format(size):
    dtype, per_token = KV_FORMAT
    app = replay_app(records=list(generate(duration_s=2)))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        kv = app.state.engine().latest["kv"]
        assert kv["cache_dtype"] == dtype and kv["bytes_per_token"] == per_token
        subtitle = str(app.screen.query_one("#kv").border_subtitle)
        short = dtype.split("_per_")[0]
        assert subtitle.startswith(dtype if size[0] >= 120 else short)
        assert f"{per_token:,} B/tok" in subtitle and f"{kv['capacity_tokens']:,} tok" in subtitle
        await pilot.press("3")
        await pilot.pause()
        legend = str(app.screen.query_one("#kv-legend").render())
        assert f"storage {dtype} · {per_token:,} B/token · {kv['capacity_tokens']:,} tokens" \
            in legend


@pytest.mark.slow
async def test_a_recording_from_before_the_kv_dtypes_shows_no_format():
    app = replay_app()          # tests/data/synthetic.vrec: no cache_dtype in its kv messages
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "cache_dtype" not in app.state.engine().latest["kv"]
        assert not app.screen.query_one("#kv").border_subtitle
        await pilot.press("3")
        await pilot.pause()
        assert "storage" not in str(app.screen.query_one("#kv-legend").render())
