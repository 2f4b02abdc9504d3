"""A rank actor's death reads as what Ray knows of it, on Ray's own texts (Ray 2.60).

The errors are Ray's real exception classes built the way Ray's deserializer builds them
(`ActorDiedError` from an `ActorDiedErrorContext`), carrying the texts the installed Ray's GCS,
raylet and core worker write: each text's fixed parts are checked against those binaries first,
so a Ray whose wording changed fails here rather than mislabels a death. The texts were seen
live: ``kill -9``, a segfault, ``abort()`` and ``os._exit(3)`` of an actor's process all give
the first one (the raylet ignores SIGCHLD: no exit status survives); ``sys.exit(3)`` and a
SIGTERM the second and third.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from vconsole.engine.dp.ray.death import death_reason, is_ray_oom

ray = pytest.importorskip("ray")
from ray.core.generated.common_pb2 import ActorDiedErrorContext  # noqa: E402

WORKER_DIED = ("The actor is dead because its worker process has died. Worker exit type: "
               "{type} Worker exit detail: {detail}")
KILLED = ("Worker unexpectedly exits with a connection error code 2. End of file. Some common "
          "causes include: (1) the process was killed by the OOM killer due to high memory "
          "usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly due to "
          "SIGSEGV or another unexpected error. If the process was killed by the kernel OOM "
          "killer (verifiable by checking for OOM in dmesg of the OOMing node), consider "
          "enabling resource isolation via --enable-resource-isolation to prevent node deaths "
          "by resource contention and significant loss of progress by uninformed kernel OOM "
          "killing.")
SYS_EXIT = "Worker exits unexpectedly. Worker exits with an exit code 3."
SIGTERM = "Worker exits unexpectedly. Worker exits with an exit code 1. The process receives a SIGTERM."
MEMORY_MONITOR = ("1 worker(s) were killed due to the node running low on memory. Memory on the "
                  "node (IP: 127.0.0.1, ID: 5f2c) was 30.50GB used / 31.00GB limit (0.983871)")
RAY_KILL = "The actor is dead because it was killed by `ray.kill`."
NODE_DIED = "The actor died because its node has died. Node Id: 5f2c"

# Each fixed part above, and the Ray binary that writes it.
WRITTEN_BY = {
    "gcs/gcs_server": ["The actor is dead because its worker process has died. Worker exit type: ",
                       " Worker exit detail: ", RAY_KILL,
                       "The actor died because its node has died. Node Id: "],
    "raylet/raylet": ["Worker unexpectedly exits with a connection error code ",
                      KILLED[KILLED.index(". Some common"):KILLED.index("If the process")],
                      "%d worker(s) were killed due to the node running low on memory. %s",
                      "Memory on the node (IP: %s, ID: %s) was %sGB used / %sGB limit (%f)"],
    "../../../_raylet.so": ["Worker exits unexpectedly. ", "Worker exits with an exit code "],
}


@cache
def ray_binary(relative: str) -> bytes:
    return (Path(ray.__file__).parent / "core/src/ray" / relative).read_bytes()


def actor_died(message: str, pid: int = 8734, rank: int = 1) -> Exception:
    """The `ActorDiedError` a pending call of rank ``rank``'s actor raises, as Ray builds it."""
    return ray.exceptions.ActorDiedError(cause=ActorDiedErrorContext(
        error_message=message, pid=pid, name=f"vconsole_dp_rank_{rank}", class_name="RankActor",
        actor_id=bytes(16), ray_namespace="vconsole-e-1", node_ip_address="127.0.0.1"))


@pytest.mark.parametrize("binary", sorted(WRITTEN_BY))
def test_the_texts_are_the_installed_rays_own(binary: str) -> None:
    data = ray_binary(binary)
    missing = [part for part in WRITTEN_BY[binary] if part.encode() not in data]
    assert missing == [], f"Ray {ray.__version__} no longer writes these: {missing}"


def test_a_killed_process_is_not_called_out_of_memory_though_rays_text_names_the_oom_killer(
        ) -> None:
    error = actor_died(WORKER_DIED.format(type="SYSTEM_ERROR", detail=KILLED))
    assert "OOM killer" in str(error)        # Ray's list of possible causes
    reason = death_reason(error, 1)
    assert reason == ("Ray actor vconsole_dp_rank_1 (pid 8734) died abruptly: killed by a "
                      "signal (such as SIGKILL) or crashed; Ray keeps no exit status")
    assert "memory" not in reason.lower() and not is_ray_oom(error)


def test_an_exit_code_or_signal_ray_saw_is_reported() -> None:
    assert death_reason(actor_died(WORKER_DIED.format(type="SYSTEM_ERROR", detail=SYS_EXIT)),
                        1) == "Ray actor vconsole_dp_rank_1 (pid 8734) exited with code 3"
    assert death_reason(actor_died(WORKER_DIED.format(type="SYSTEM_ERROR", detail=SIGTERM),
                                   pid=77, rank=0), 0) == \
        "Ray actor vconsole_dp_rank_0 (pid 77) exited with code 1 after SIGTERM"


def test_out_of_memory_only_when_rays_memory_monitor_says_so() -> None:
    oom = ray.exceptions.OutOfMemoryError(MEMORY_MONITOR)     # the failed call's error
    assert is_ray_oom(oom)
    assert death_reason(oom, 1) == ("Ray actor vconsole_dp_rank_1 killed by Ray's memory "
                                    "monitor: out of memory on its node (30.50GB used / "
                                    "31.00GB limit)")
    by_exit_type = actor_died(WORKER_DIED.format(type="NODE_OUT_OF_MEMORY",
                                                 detail=MEMORY_MONITOR))
    assert death_reason(by_exit_type, 1).startswith(
        "Ray actor vconsole_dp_rank_1 (pid 8734) killed by Ray's memory monitor")


def test_ray_kill_and_a_lost_node_are_named() -> None:
    assert death_reason(actor_died(RAY_KILL), 1) == "Ray actor vconsole_dp_rank_1 killed by ray.kill"
    assert death_reason(actor_died(NODE_DIED), 2) == "Ray actor vconsole_dp_rank_2: its node died"


def test_an_unknown_text_gives_its_cause_line_not_rays_generic_first_line() -> None:
    error = actor_died("The actor is dead because all references to the actor were removed.")
    assert death_reason(error, 0) == ("Ray actor vconsole_dp_rank_0: The actor is dead because "
                                      "all references to the actor were removed.")
