"""A console of several sources (a fleet is N of them): each feeds the one state under the keys
of the engines it heard; the header, the recording and a source's actions are those of the
selected engine's source; the state's clock and the control channel's read-only reason are the
first source's."""

from __future__ import annotations

import pytest

from support.synthetic import generate
from vconsole.console.app import VConsoleApp
from vconsole.console.sources.source import Source
from vconsole.console.sources.stream import ReplaySource, ZmqSource
from vconsole.console.sources.vllm import VllmSource

pytestmark = pytest.mark.slow


def replay(name: str, engine: str) -> ReplaySource:
    return ReplaySource(name, speed=0,
                        records=lambda: generate(duration_s=3, engine=engine, seed=len(name)))


def test_every_kind_of_source_is_a_source():
    for source in (ZmqSource(["tcp://127.0.0.1:9101"]), replay("a.vrec", "alpha-0"),
                   VllmSource("http://127.0.0.1:9102", local_gpu=False)):
        assert isinstance(source, Source)


async def test_two_sources_feed_one_state_and_the_selected_engines_source_is_shown(tmp_path):
    a, b = replay("a.vrec", "alpha-0"), replay("b.vrec", "beta-0")
    app = VConsoleApp(sources=[a, b], record_dir=tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert list(app.state.engines) == ["alpha-0/0", "beta-0/0"]
        assert a.engine_keys == {"alpha-0/0"} and b.engine_keys == {"beta-0/0"}
        assert app.state.clock == a.now and app.readonly_reason == "replay"
        assert app.frame("overview").source.startswith("■ END a.vrec")
        await pilot.press("n")                               # the next engine: beta's source
        await pilot.pause()
        assert app.current_engine().key == "beta-0/0"
        assert app.source_of(app.current_engine()) is b
        assert app.frame("overview").source.startswith("■ END b.vrec")
        await pilot.press("R")                               # records the source shown
        await pilot.pause()
        assert b.recording and not a.recording
        assert app.frame("overview").recording == b.recording_path
        await pilot.press("R")
        await pilot.pause()
        assert not b.recording
