"""``D`` pauses and resumes speculative decoding: the hot key ``speculative_decoding`` goes
to the engine through the control channel as any config change does; an engine without a
``speculative_config`` is told so and nothing is sent."""

from __future__ import annotations

from support.console_testing import FakeControl, replay_app, until
from vconsole.shared.config import EngineConfig

SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


def _sets(ctl: FakeControl) -> list[dict]:
    return [v for name, v in ctl.calls if name == "set_config" and v is not None]


async def test_d_pauses_and_resumes_speculation_through_the_control_channel():
    ctl = FakeControl(EngineConfig(num_kv_blocks=1024, max_num_seqs=32,
                                   speculative_config=SPEC))
    app = replay_app(control=ctl, records=[])
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.state.config is not None)
        await pilot.press("D")
        await until(pilot, lambda: ctl.config.speculative_decoding is False)
        await until(pilot, lambda: app.state.config.values["speculative_decoding"] is False)
        await pilot.press("D")
        await until(pilot, lambda: ctl.config.speculative_decoding is True)
        assert _sets(ctl) == [{"speculative_decoding": False}, {"speculative_decoding": True}]


async def test_d_without_speculation_configured_says_so_and_sends_nothing():
    ctl = FakeControl()
    app = replay_app(control=ctl, records=[])
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.state.config is not None)
        await pilot.press("D")
        await pilot.pause(0.2)
        assert _sets(ctl) == []
        assert any("not configured" in str(n.message) for n in app._notifications)
