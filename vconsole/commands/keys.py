"""`vconsole keys DIR [--client NAME]`: make CURVE key pairs and say how to use them."""

from __future__ import annotations

import argparse

from vconsole.commands import fail
from vconsole.security.curve import CurveKeyError, make_keys


def main(args: argparse.Namespace) -> int:
    try:
        keys = make_keys(args.dir, getattr(args, "client", None) or "client")
    except (CurveKeyError, OSError) as e:
        return fail("keys", e, 2)
    made = "made" if keys.server_created else "kept"
    print(f"server key pair ({made}): {keys.server_secret} (secret, 0600), "
          f"{keys.server_public} (public)")
    print(f"client key pair: {keys.client_secret} (secret, 0600), {keys.client_public} (public), "
          f"authorised in {keys.authorized}/")
    print("\nengine (on the GPU box):")
    print(f"  vconsole engine --curve-server-key {keys.server_secret} "
          f"--curve-clients {keys.authorized} \\")
    print("      --input tcp://0.0.0.0:5570 --output tcp://0.0.0.0:5571 "
          "--telemetry tcp://0.0.0.0:5572 --control tcp://0.0.0.0:5573")
    print("clients (set, get, attach, load, top, record): copy only "
          f"{keys.server_public.name} and {keys.client_secret.name} to the client machine, then")
    print(f"  --curve-server-public {keys.server_public} --curve-client-key {keys.client_secret}")
    print("changing the config (set, the console) also needs the engine's control key file, "
          "new at each engine start: copy it too and pass --control-key-file PATH")
    return 0
