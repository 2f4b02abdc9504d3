"""Data parallel over several hosts, on one: ``torchrun --nnodes 2`` ranks bound on
``--dp-rank-host`` as CURVE servers (``--dp-curve-dir``, a `vconsole keys DIR` folder), the
front end their only authorised client, each rank's control key handed over in its ``ready``;
and the refusals that come before anything binds (a remote rank host without keys, a wildcard
host, a keyless folder, the flags outside torchrun)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from tests.support.live_engine import Telemetry, ipc_endpoints
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.child import ChildProcess
from vconsole.security.control_key import ENV_RUNTIME_DIR, key_file_name
from vconsole.security.curve import ClientCurve, load_client_curve, read_public_key
from vconsole.wire.ready_file import read_ready_file

pytestmark = [pytest.mark.proc]

RANK_READY = re.compile(r"ready \(pid \d+\): input=(\S+) output=(\S+) telemetry=\S+ control=(\S+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vconsole(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vconsole", *argv], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def _torchrun_env(port: int) -> dict[str, str]:
    """A torchrun worker's environment, with a store nobody listens on."""
    return {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


@pytest.mark.parametrize(("flags", "message"), [
    (["--dp-rank-host", "10.1.2.3"],
     "refusing to bind non-loopback endpoint(s) input=tcp://10.1.2.3:*"),
    (["--dp-rank-host", "0.0.0.0", "--dp-curve-dir", "KEYS"],
     "--dp-rank-host '0.0.0.0': give this node's IPv4 address"),
    (["--dp-curve-dir", "EMPTY"], "server.key_secret"),
], ids=["remote-host-without-keys", "wildcard-host", "keyless-folder"])
def test_a_rank_refuses_what_it_cannot_serve_safely_before_anything_binds(
        tmp_path: Path, flags: list[str], message: str) -> None:
    if "KEYS" in flags:
        assert _vconsole("keys", str(tmp_path / "keys")).returncode == 0
    (tmp_path / "empty").mkdir()
    flags = [{"KEYS": str(tmp_path / "keys"), "EMPTY": str(tmp_path / "empty")}.get(f, f)
             for f in flags]
    eps = ipc_endpoints(tmp_path)
    done = _vconsole("engine", *flags, *[f"--{n}={ep}" for n, ep in eps.items()],
                     env={**_torchrun_env(_free_port()), ENV_RUNTIME_DIR: str(tmp_path / "run")})
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    # first: no store was tried (its error would be a rendezvous one), no public endpoint bound
    assert "rendezvous" not in done.stderr.lower() and "store" not in done.stderr.lower()
    assert not any(Path(ep.removeprefix("ipc://")).exists() for ep in eps.values())
    assert "ready" not in done.stdout


def test_the_multi_host_flags_are_refused_outside_torchrun() -> None:
    done = _vconsole("engine", "--data-parallel-size", "2", "--dp-rank-host", "10.1.2.3")
    assert done.returncode == 2
    assert "--dp-rank-host is for torchrun workers" in done.stderr and "ready" not in done.stdout


def _refused(curve: ClientCurve | None, input_ep: str, output_ep: str) -> bool:
    client = EngineClient(input_ep, output_ep, timeout_s=1, curve=curve)
    try:
        client.connect()
    except TimeoutError:
        return True
    finally:
        client.close()
    return False


def _host_address() -> str:
    """A non-loopback IPv4 address of this machine (no packet is sent), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))
            address = str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
    return "127.0.0.1" if address.startswith("127.") or address == "0.0.0.0" else address


def _nodes(tmp_path: Path, keys: Path, eps: dict[str, str]) -> list[tuple[ChildProcess, Path]]:
    """``torchrun --nnodes 2`` as two nodes would run it, one rank each: node 1's rank binds
    this machine's non-loopback address, and each node has its own runtime folder, so the front
    end (node 0) cannot read node 1's key file, as on two hosts."""
    port = _free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    nodes = []
    for node, host in ((0, "127.0.0.1"), (1, _host_address())):
        cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "vconsole",
               "engine", "--num-kv-blocks", "64", "--block-size", "8",
               "--set", "heartbeat_interval_s=0.2", "--dp-rank-host", host,
               "--dp-curve-dir", str(keys), "--ready-file", str(tmp_path / "ready.json"),
               *[f"--{n}={ep}" for n, ep in eps.items()]]
        log = tmp_path / f"node{node}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", ENV_RUNTIME_DIR: str(tmp_path / f"run{node}")}
        with open(log, "wb") as out:
            nodes.append((ChildProcess(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                       own_group=True), log))
    return nodes


@pytest.mark.slow
def test_torchrun_ranks_on_two_nodes_behind_curve_serve_only_their_front_end(
        tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    made = _vconsole("keys", str(keys))
    assert made.returncode == 0, made.stderr
    eps = ipc_endpoints(tmp_path)
    nodes = _nodes(tmp_path, keys, eps)

    def logs() -> str:
        return "".join(log.read_text() for _, log in nodes)

    try:
        deadline = time.monotonic() + 120
        while read_ready_file(tmp_path / "ready.json") is None:
            assert all(p.poll() is None for p, _ in nodes) and time.monotonic() < deadline, \
                logs()[-3000:]
            time.sleep(0.1)
        # The ready file can come before the other node's rank has logged its line: wait for it.
        ranks = [RANK_READY.findall(log.read_text()) for _, log in nodes]
        while [len(r) for r in ranks] != [1, 1] and time.monotonic() < deadline:
            time.sleep(0.1)
            ranks = [RANK_READY.findall(log.read_text()) for _, log in nodes]
        assert [len(r) for r in ranks] == [1, 1], ranks
        ranks = [r[0] for r in ranks]               # node 0's rank, node 1's rank
        assert ranks[0][0].startswith("tcp://127.0.0.1:")
        assert ranks[1][0].startswith(f"tcp://{_host_address()}:")
        assert not (tmp_path / "run0" / key_file_name(ranks[1][2])).exists()
        telemetry = Telemetry(eps["telemetry"])
        try:
            with EngineClient(eps["input"], eps["output"], timeout_s=30) as c:
                assert c.engine_info["data_parallel_size"] == 2
                assert "control_key" not in c.engine_info    # never past the front end
                ids = [c.submit(prompt_token_ids=[2, 4, 6, i], max_tokens=8) for i in range(6)]
                done = c.gather(ids, timeout_s=60)
                assert [done[i].finish_reason for i in ids] == ["length"] * 6
                for rank in (0, 1):
                    telemetry.wait_for("health", lambda p, r=rank: p["rank"] == r
                                       and p["steps"] > 0, timeout_s=10)

                # Node 1's key file is on node 1; the front end does not read node 0's either.
                (tmp_path / "run0" / key_file_name(ranks[0][2])).unlink()
                changed = _vconsole("set", "--control", eps["control"], "max_num_seqs=12",
                                    env={ENV_RUNTIME_DIR: str(tmp_path / "run0")})
                assert changed.returncode == 0, changed.stdout + changed.stderr
                assert re.findall(r"rank (\d)  applied", changed.stdout) == ["0", "1"]

                # Straight to a rank: no keys, or keys it does not list, get no handshake.
                server_public = read_public_key(keys / "server.key")
                stranger = ClientCurve(server_public, *zmq.curve_keypair())
                for input_ep, output_ep, _ in ranks:
                    assert _refused(None, input_ep, output_ep)
                    assert _refused(stranger, input_ep, output_ep)
                # ... while the authorised key (the front end's) gets each rank's control key.
                ours = load_client_curve(keys / "server.key", keys / "client.key_secret")
                infos = []
                for input_ep, output_ep, _ in ranks:
                    with EngineClient(input_ep, output_ep, timeout_s=10, curve=ours) as direct:
                        infos.append(direct.engine_info)
                assert [i["dp_rank"] for i in infos] == [0, 1]
                assert len({i["control_key"] for i in infos}) == 2
                assert all(len(i["control_key"]) == 64 for i in infos)

                later = [c.submit(prompt_token_ids=[3, 5, i], max_tokens=4) for i in range(4)]
                again = c.gather(later, timeout_s=60)
                assert [again[i].finish_reason for i in later] == ["length"] * 4
        finally:
            telemetry.close()
        for proc, _ in nodes:
            proc.send_signal(signal.SIGTERM)                 # the node's whole group
        for proc, _ in nodes:
            proc.wait(60)
        assert logs().count("engine stopped (SIGTERM)") == 2   # every rank drained
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait()
