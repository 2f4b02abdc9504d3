"""The CURVE flags (`vconsole.cli.add_curve_args`) read for a command: the flag names in one
place, and a `CurveKeyError` with the reason instead of a traceback when a file is wrong."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from vconsole.security.curve import ClientCurve, load_client_curve

if TYPE_CHECKING:
    from vconsole.security.curve_server import ServerCurve


def client_curve(args: argparse.Namespace) -> ClientCurve | None:
    """``--curve-server-public`` + ``--curve-client-key``; None when neither is given."""
    return load_client_curve(getattr(args, "curve_server_public", None),
                             getattr(args, "curve_client_key", None))


def server_curve(args: argparse.Namespace) -> ServerCurve | None:
    """``--curve-server-key`` + ``--curve-clients``; None when neither is given."""
    from vconsole.security.curve_server import load_server_curve

    return load_server_curve(getattr(args, "curve_server_key", None),
                             getattr(args, "curve_clients", None))
