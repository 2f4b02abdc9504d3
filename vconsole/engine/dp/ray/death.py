"""Why a rank actor died, in a few words, from Ray's error: what Ray knows, and no more.

Ray (2.60) tells the owner of a dead actor through the error of its pending call. The text of
an `ActorDiedError` is its GCS's: ``The actor is dead because its worker process has died.
Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection
error code 2. End of file. Some common causes include: (1) the process was killed by the OOM
killer ...``. That text is the same for ``kill -9``, a segfault, ``abort()`` and ``os._exit(3)``:
the raylet ignores SIGCHLD, so the worker's exit status is gone before anyone could read it,
and the list of "common causes" names the OOM killer only as one possibility. So such a death
reads as what it is — the process died abruptly, killed by a signal or crashed — never as out
of memory.

Out of memory only when Ray says so for certain: its memory monitor killed the worker (the
call fails with `ray.exceptions.OutOfMemoryError`, or the worker's exit type is
``NODE_OUT_OF_MEMORY``, with the monitor's "killed due to the node running low on memory").
An exit code or signal Ray did see (``Worker exits with an exit code 3``, ``... Exit code: 1.
The process receives a SIGTERM.``) is reported as such; ``ray.kill`` and a dead node by name.
"""

from __future__ import annotations

import re

from vconsole.engine.dp.ray.actor import actor_name

# The raylet's memory monitor (the one definitive out-of-memory word) and the exit type it sets.
MEMORY_MONITOR = "killed due to the node running low on memory"
OOM_EXIT_TYPE = "NODE_OUT_OF_MEMORY"
# A worker that vanished without telling its raylet (SIGKILL, a crash, a hard exit).
CONNECTION_LOST = "exits with a connection error code"
GENERIC = "The actor died unexpectedly before finishing this task."   # ActorDiedError's 1st line

_PID = re.compile(r"^\s*pid: (\d+)\s*$", re.MULTILINE)
_EXIT_TYPE = re.compile(r"Worker exit type: (\w+)")
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.*)", re.DOTALL)
_EXIT_CODE = re.compile(r"[Ee]xit code:? (-?\d+)")
_SIGNAL = re.compile(r"\b(SIG[A-Z]+\d?)\b")
_MEMORY = re.compile(r"was ([\d.]+ ?GB used / [\d.]+ ?GB limit)")


def is_ray_oom(error: BaseException) -> bool:
    """Ray's memory monitor killed the actor (never the mere mention of an OOM killer)."""
    if any(c.__name__ == "OutOfMemoryError" and c.__module__.startswith("ray")
           for c in type(error).__mro__):
        return True
    text = str(error)
    return MEMORY_MONITOR in text or f"Worker exit type: {OOM_EXIT_TYPE}" in text


def death_reason(error: BaseException, rank: int) -> str:
    """A short reason for rank ``rank``'s actor's death, from Ray's error (module docstring)."""
    text = str(error)
    name = actor_name(rank)
    pid_match = _PID.search(text)
    pid = f" (pid {pid_match.group(1)})" if pid_match else ""
    if "ray.kill" in text:
        return f"Ray actor {name} killed by ray.kill"
    if is_ray_oom(error):
        memory = _MEMORY.search(text)
        return (f"Ray actor {name}{pid} killed by Ray's memory monitor: out of memory on its "
                "node" + (f" ({memory.group(1)})" if memory else ""))
    if type(error).__name__ == "NodeDiedError" or "its node has died" in text:
        return f"Ray actor {name}: its node died"
    if "its owner has died" in text:
        return f"Ray actor {name}: its owner (this engine's Ray driver) died"
    exit_type = _EXIT_TYPE.search(text)
    if exit_type is not None:
        detail_match = _EXIT_DETAIL.search(text)
        detail = detail_match.group(1) if detail_match else ""
        if CONNECTION_LOST in detail:
            return (f"Ray actor {name}{pid} died abruptly: killed by a signal (such as SIGKILL) "
                    "or crashed; Ray keeps no exit status")
        code = _EXIT_CODE.search(detail)
        if code is not None:
            sig = _SIGNAL.search(detail)
            return (f"Ray actor {name}{pid} exited with code {code.group(1)}"
                    + (f" after {sig.group(1)}" if sig else ""))
        first = detail.strip().split(". ")[0].rstrip(".") or exit_type.group(1)
        return f"Ray actor {name}{pid} exited ({exit_type.group(1)}): {first[:160]}"
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()
                  and not ln.startswith("\t") and ln.strip() != GENERIC), type(error).__name__)
    return f"Ray actor {name}: {first[:200]}"
