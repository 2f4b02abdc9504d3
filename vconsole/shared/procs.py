"""Which process, on which machine: the checks every reader of another process's pid shares.

A pid names a process only together with the machine (`host_identity`: the host name and this
boot's id, so a rebooted or cloned host is another one) and the process's start time
(`process_start`: a pid reused after its process died has another). `pid_alive` is the plain
"does the pid exist here" check. Standard library only.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22): with
    the pid, it names one process for good. None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def host_identity() -> dict[str, str]:
    """``{"name": host name, "boot_id": this boot's id ("" where the OS has none)}``."""
    try:
        boot = Path(BOOT_ID_FILE).read_text().strip()
    except OSError:
        boot = ""
    return {"name": socket.gethostname(), "boot_id": boot}


def same_host(other: object) -> bool:
    """Whether ``other`` (a `host_identity` from a message) names this machine. A boot id on
    both sides decides; else the host names."""
    if not isinstance(other, dict):
        return False
    here = host_identity()
    if other.get("boot_id") and here["boot_id"]:
        return bool(other.get("boot_id") == here["boot_id"] and other.get("name") == here["name"])
    return bool(other.get("name") == here["name"])
