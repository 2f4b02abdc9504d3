"""What the console may ask a vLLM server to do, over the routes vLLM's API server has.

vLLM has no runtime config API, but its server answers a few actions: ``POST
/reset_prefix_cache``, ``POST /sleep?level=1`` / ``POST /wake_up`` (with ``GET /is_sleeping``),
only when started with ``VLLM_SERVER_DEV_MODE=1``; and ``POST /start_profile`` / ``POST
/stop_profile``, only with a profiler configured (``--profiler-config``, older
``VLLM_TORCH_PROFILER_DIR``). `probe` finds the dev-mode routes (``GET /is_sleeping``); the
console offers only those a server has. A route the server does not answer is a 404: the action
then says so and how to enable it, and nothing else happens. The console offers these behind its
confirmation box, never on ``--readonly``.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from vconsole.console.sources.source import ActionError

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class VllmAction:
    key: str
    title: str
    path: str
    consequence: str
    needs: str          # how a server that answers 404 enables the route
    dev_mode: bool = False   # a VLLM_SERVER_DEV_MODE route (found by `probe`)


ACTIONS = (
    VllmAction("reset_prefix_cache", "Reset the prefix cache", "/reset_prefix_cache",
               "Every cached prefix block is forgotten: the next requests recompute their "
               "prompts (higher TTFT until the cache refills). Running requests keep their "
               "blocks.", "start vLLM with VLLM_SERVER_DEV_MODE=1", dev_mode=True),
    VllmAction("start_profile", "Start the profiler", "/start_profile",
               "vLLM's profiler records every step until stopped: the server slows down while "
               "it runs and writes a trace on stop.",
               "start vLLM with --profiler-config (older: VLLM_TORCH_PROFILER_DIR)"),
    VllmAction("stop_profile", "Stop the profiler", "/stop_profile",
               "The profiler stops and vLLM writes its trace.",
               "start vLLM with --profiler-config (older: VLLM_TORCH_PROFILER_DIR)"),
    VllmAction("sleep", "Put the engine to sleep (level 1)", "/sleep?level=1",
               "The engine offloads its weights and drops its KV cache: it serves nothing until "
               "woken up.", "start vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode",
               dev_mode=True),
    VllmAction("wake_up", "Wake the engine up", "/wake_up",
               "The engine reloads its weights and KV cache, then serves again.",
               "start vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode", dev_mode=True),
)
BY_KEY = {a.key: a for a in ACTIONS}


def probe(root: str, timeout_s: float = 5.0) -> tuple[VllmAction, ...]:
    """The actions this server answers, as far as a harmless request can tell: its dev-mode
    routes exist when ``GET /is_sleeping`` answers; the profiler's routes have no such probe
    and are always offered (a 404 then says how to enable them)."""
    try:
        with urllib.request.urlopen(root + "/is_sleeping", timeout=timeout_s) as resp:  # noqa: S310
            dev = resp.status == 200
    except (urllib.error.URLError, OSError):
        dev = False
    return tuple(a for a in ACTIONS if dev or not a.dev_mode)


def run_action(root: str, key: str, api_key: str | None = None) -> str:
    """POST the action's route; the server's answer in a line, or `ActionError`."""
    action = BY_KEY[key]
    req = urllib.request.Request(root + action.path, data=b"", method="POST")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310
            body = resp.read(200).decode("utf-8", "replace").strip()
            return f"{action.title}: done (HTTP {resp.status}){': ' + body if body else ''}"
    except urllib.error.HTTPError as e:
        if e.code in (404, 405):
            raise ActionError(f"{action.title}: the server does not answer POST "
                              f"{action.path.split('?')[0]} (HTTP {e.code}); {action.needs}") \
                from None
        raise ActionError(f"{action.title}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ActionError(f"{action.title}: {getattr(e, 'reason', e)}") from None
