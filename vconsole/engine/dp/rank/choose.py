"""Which role an engine process plays: a lone engine, or one rank of a data-parallel group.

The launcher (`vconsole.commands.engine`) asks here and passes the answer to
`vconsole.engine.process.core_proc.EngineCoreProc`, as vLLM picks ``DPEngineCoreProc`` over
``EngineCoreProc``: the engine process itself never imports the data-parallel package. Choosing
has no side effect; the rank reaches its store in `RankRole.join`, which the process calls
after its bind checks and before anything binds.
"""

from __future__ import annotations

from collections.abc import Mapping

from vconsole.engine.dp.rank.rendezvous import DPEnv
from vconsole.engine.process.process_role import LoneEngine, ProcessRole
from vconsole.shared.config import EngineConfig


def process_role(config: EngineConfig, environ: Mapping[str, str] | None = None) -> ProcessRole:
    """A `RankRole` when the flags (``--dp-rank``) or torchrun's environment make this process
    a rank (`DPEnv`), else a `LoneEngine`."""
    env = DPEnv.from_config(config, environ)
    if not env.is_rank:
        return LoneEngine()
    # torch (the process group) is imported by ranks only: a lone engine binds its sockets
    # before it loads torch, so a busy port fails fast.
    from vconsole.engine.dp.rank.rank_role import RankRole

    return RankRole(env)
