"""Which endpoints count as loopback: the gate in front of every bind."""

import pytest

from vconsole.security.endpoints import DEFAULTS, is_loopback


@pytest.mark.parametrize("ep", ["tcp://127.0.0.1:5570", "tcp://127.8.9.10:1", "tcp://[::1]:5",
                                "tcp://localhost:9", "ipc:///tmp/x.sock", "inproc://a"])
def test_loopback_endpoints(ep):
    assert is_loopback(ep)


@pytest.mark.parametrize("ep", ["tcp://0.0.0.0:5570", "tcp://*:5570", "tcp://10.0.0.1:1",
                                "tcp://127.evil.example.com:1", "tcp://eth0:1", "udp://127.0.0.1:1"])
def test_everything_else_is_not(ep):
    assert not is_loopback(ep)


def test_every_default_binds_loopback():
    assert all(is_loopback(ep) for ep in DEFAULTS.values())
