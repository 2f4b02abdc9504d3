"""How torch's OpenMP threads wait between two parallel regions, on a CPU-only engine.

torch's CPU kernels run on one OpenMP thread per core. Between two regions GNU OpenMP's
threads spin by default, and every region waits for its slowest thread: when another busy
process holds one of the cores (a load generator, a publisher process restarting, a test
beside it), the thread that lost its core holds up each region for a whole scheduler slice, and
the engine slows many times over. Measured on a 2-core machine (`vconsole engine --model
tiny`, `vconsole load --concurrency 16 or 32`, alternated pairs):

- beside four other busy processes: 179-686 output tok/s with the default spin (300,000
  rounds), 3,282-4,512 with ``OMP_WAIT_POLICY=PASSIVE`` (inter-token p99 0.5-1.1 s against
  26-38 ms);
- beside two busy processes: default 843-856 tok/s, passive 1,875, a short spin
  (``GOMP_SPINCOUNT=2000``, microseconds) 1,867-1,881;
- quiet: default 4,511-4,996, short spin 4,650-4,796, passive 3,836-4,366 (sleeping costs a
  wake-up per region when nothing else wants the core).

So an engine on a machine without an NVIDIA GPU starts with a short spin (`SPIN` rounds, then
its threads sleep): the quiet speed of spinning, the loaded speed of sleeping — unless the user
chose a policy (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) themselves. The
library reads its environment once, when torch is first imported: `prefer_short_spin` is called
by the engine command before anything imports torch, and the processes it starts (supervised
child, data-parallel ranks, Ray actors) inherit it.

No torch here: it must run before torch is imported.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
USER_KNOBS = (POLICY, SPIN_COUNT)
SPIN = "2000"
GPU_DEVICE = "/dev/nvidia0"


def prefer_short_spin(environ: MutableMapping[str, str] | None = None, *,
                      gpu: bool | None = None) -> str:
    """Set ``GOMP_SPINCOUNT=SPIN`` in ``environ`` (this process's by default) unless the user
    chose a wait policy or the machine has an NVIDIA GPU (whose engine's host threads hardly
    matter). Returns what is in effect, for the start-up line: ``passive``, ``active``,
    ``spin N rounds, then sleep`` or ``library default``."""
    env = os.environ if environ is None else environ
    if gpu is None:
        gpu = os.path.exists(GPU_DEVICE)
    if not gpu and not any(k in env for k in USER_KNOBS):
        env[SPIN_COUNT] = SPIN
    return describe(env)


def describe(environ: MutableMapping[str, str] | None = None) -> str:
    """The wait policy the environment asks for, in words."""
    env = os.environ if environ is None else environ
    policy = env.get(POLICY, "").strip().lower()
    if policy in ("passive", "active"):
        return policy
    if env.get(SPIN_COUNT):
        return f"spin {env[SPIN_COUNT]} rounds, then sleep"
    return "library default"
