"""The CURVE flags (`vconsole.commands.flags.add_curve_args`) read for a command: the flag names in one
place, and a `CurveKeyError` with the reason instead of a traceback when a file is wrong."""

from __future__ import annotations

import argparse

from vconsole.security.curve import ClientCurve, load_client_curve


def client_curve(args: argparse.Namespace) -> ClientCurve | None:
    """``--curve-server-public`` + ``--curve-client-key``; None when neither is given."""
    return load_client_curve(getattr(args, "curve_server_public", None),
                             getattr(args, "curve_client_key", None))

