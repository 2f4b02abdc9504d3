"""A minimal telemetry subscriber, the kind a third party writes from docs/PROTOCOL.md.

Deliberately uses only pyzmq and msgpack (not `vconsole.telemetry.schema`): copy this file and go.
Prints one line per message and counts messages lost to the publisher's high-water mark from
per-topic ``seq`` gaps. Run: ``python -m vconsole.telemetry.subscriber [ENDPOINT] [COUNT]``.
"""

import contextlib
import sys

import msgpack
import zmq

SCHEMA_VERSION = 1


def run(endpoint: str = "tcp://127.0.0.1:5572", count: int | None = None,
        timeout_s: float | None = None, out=sys.stdout) -> tuple[int, int]:
    """Print up to ``count`` messages (None: forever), stopping after ``timeout_s`` of silence;
    returns (messages printed, messages lost)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic; b"kv" would give only kv
    sock.connect(endpoint)
    last_seq: dict[tuple[str, int, bytes], int] = {}
    lost, n = 0, 0
    try:
        while count is None or n < count:
            if timeout_s is not None and not sock.poll(int(timeout_s * 1000)):
                break
            topic, payload, *buffers = sock.recv_multipart()
            msg = msgpack.unpackb(payload, raw=False)
            if msg.get("v") != SCHEMA_VERSION:
                print(f"skipping schema version {msg.get('v')}", file=out)
                continue
            key = (msg["engine"], msg["rank"], topic)
            if key in last_seq and msg["seq"] > last_seq[key] + 1:
                lost += msg["seq"] - last_seq[key] - 1
            last_seq[key] = msg["seq"]
            scalars = [f"{k}={v}" for k, v in msg.items()
                       if k not in ("v", "ts", "engine", "rank", "seq")
                       and isinstance(v, int | float | str | bool)][:6]
            extra = f" +{sum(len(b) for b in buffers)}B raw" if buffers else ""
            print(f"{topic.decode()} {msg['engine']}/{msg['rank']} seq={msg['seq']} "
                  f"{' '.join(scalars)}{extra}", file=out, flush=True)
            n += 1
    finally:
        sock.close()
    return n, lost


if __name__ == "__main__":
    ep = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5572"
    with contextlib.suppress(KeyboardInterrupt):
        run(ep, int(sys.argv[2]) if len(sys.argv) > 2 else None)
