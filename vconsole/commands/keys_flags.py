"""`vconsole keys`'s parser (its handler: `vconsole.commands.keys`). Light imports only:
`vconsole --help` loads it."""

from __future__ import annotations

from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(
        subparsers, "keys", "vconsole.commands.keys:main", "make CURVE key pairs for remote use",
        "Write a CURVE server key pair and a client key pair (zmq.auth certificates; secret "
        "files mode 0600) into DIR, and authorise the client by copying its public key into "
        "DIR/authorized_clients. Run again with --client NAME to add another client; the "
        "server pair is kept. Existing key files are never overwritten.")
    p.add_argument("dir", metavar="DIR", help="where to write the keys (created mode 0700)")
    p.add_argument("--client", default="client", metavar="NAME",
                   help="the client pair's name: NAME.key, NAME.key_secret (default client)")
