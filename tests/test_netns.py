"""The network-namespace fixture itself: hosts reach each other over eth0 and vanish afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from netns import hosts

ECHO_SERVER = """
import socket
s = socket.socket()
s.bind(("0.0.0.0", 5555))
s.listen()
print("listening", flush=True)
conn, peer = s.accept()
conn.sendall(peer[0].encode())
"""


@pytest.mark.timeout(60)
def test_two_hosts_talk_over_their_own_addresses_and_are_removed():
    with hosts(2) as net:
        server = net.popen(1, [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        client = net.run(
            0,
            [
                sys.executable,
                "-c",
                f"import socket; s = socket.create_connection(('{net.addr(1)}', 5555), timeout=5);"
                "print(s.recv(100).decode())",
            ],
            timeout=30,
        )
        assert client.stdout.strip() == net.addr(0), client.stderr  # the peer saw host 0's own address
        names = [*net.names, net.switch]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in left for name in names)
