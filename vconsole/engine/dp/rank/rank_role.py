"""`RankRole`: a data-parallel rank's seat in the engine process's busy loop.

The loop (`vconsole.engine.process.core_proc.EngineCoreProc`) knows its role only as a
`vconsole.engine.process.process_role.ProcessRole`; a rank's is this one, picked by whoever starts the
process (`vconsole.engine.dp.rank.choose.process_role`), as vLLM picks ``DPEngineCoreProc``.
It joins the group's store before anything binds (`join`), reads the front end's
``start_wave`` / ``regroup`` (`front_end_input`), and turns what `DPRank` decides between steps
into the loop's outputs: a wave that starts or completes goes to the ``wave`` topic and, when the
front end must hear it, as a ``wave`` message to every client; a regroup publishes the ``dp``
topic before and after the group forms. Everything but `front_end_input` runs on the busy
loop's thread.
"""

from __future__ import annotations

import logging
from typing import Any

from vconsole.engine.dp.rank.dp_rank import DPRank, WaveEvent, split_cpu_threads
from vconsole.engine.dp.rank.rendezvous import DPEnv
from vconsole.engine.process.loop_inputs import FrontEnd
from vconsole.engine.process.process_role import LoopLinks
from vconsole.shared.config import EngineConfig
from vconsole.wire import protocol

log = logging.getLogger("vconsole.engine")


class RankRole:
    """One rank's `ProcessRole`; `join` before any other call, `attach` before the loop."""

    is_rank = True
    rank: DPRank          # set by `join`
    _links: LoopLinks     # set by `attach`

    def __init__(self, env: DPEnv, placement: dict[str, Any] | None = None) -> None:
        """``placement``: where the rank runs, for its ``dp`` topic (`DPRank`)."""
        self.env = env
        self.placement = placement

    @property
    def in_wave(self) -> bool:
        return self.rank.in_wave

    def join(self, config: EngineConfig) -> EngineConfig:
        """The rank's config (its own values); connects to the store (`RendezvousError`, an
        OSError, when it cannot be reached) and splits the CPU threads between the ranks."""
        config = self.env.apply(config)
        self.rank = DPRank(self.env, config, placement=self.placement)
        threads = split_cpu_threads(self.env, config)
        log.info("data-parallel rank %d of %d%s", self.env.rank, self.env.world_size,
                 f" ({threads} CPU threads)" if threads else "")
        return config

    def attach(self, links: LoopLinks) -> None:
        self._links = links
        self.rank.device = links.device

    def front_end_input(self, kind: str, header: dict[str, Any]) -> FrontEnd:
        return FrontEnd(kind, protocol.parse_start_wave(header) if kind == protocol.START_WAVE
                        else protocol.parse_regroup(header))

    def on_front_end(self, kind: str, value: int) -> None:
        self._announce(self.rank.on_front_end(kind, value, self._links.submit_dp))

    def before_step(self, has_work: bool) -> None:
        self._announce(self.rank.maybe_start(has_work))

    def after_step(self, dummy: bool, busy: bool) -> None:
        self._announce(self.rank.after_step(dummy, busy))

    def dp_body(self) -> dict[str, Any]:
        return self.rank.dp_body()

    def publish_ready(self, record: dict[str, Any]) -> None:
        self.rank.publish_ready(record)

    def close(self) -> None:
        self.rank.close()

    def _announce(self, ev: WaveEvent | None) -> None:
        """A wave started or completed here: the ``wave`` topic, and (``notify``) a ``wave``
        message to every client that said hello — in data parallel, the front end."""
        if ev is None:
            return
        self._links.submit_wave(ev.body)
        if ev.notify:
            self._links.send_wave(ev.event, ev.wave)
        self._links.changed()
