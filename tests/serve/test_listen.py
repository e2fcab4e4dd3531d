"""What the default config listens on: the HTTP and gRPC proxies on loopback only
(network.host), read from the kernel's table of listening sockets, not from our config."""

from pathlib import Path

import pytest


def listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} give them) with a socket listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.rpartition(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                out.add(addr)
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_default_http_proxy_listens_on_loopback_only(serve_ports):
    _, http = serve_ports
    addrs = listening(http)
    assert addrs == {"0100007F"}, addrs  # 127.0.0.1, little-endian hex; no 0.0.0.0 (00000000) or [::]


# 127.0.0.1, as IPv4 and as IPv4-mapped IPv6 (gRPC's dual-stack socket), and ::1 (hex, as
# /proc/net/tcp{,6} give them)
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_default_grpc_proxy_listens_on_loopback_only(serve_ports):
    import ray

    from cluster.serve.proxy_patch import RAY_VERSION

    # the bind address is a patch of Ray's proxy (cluster.serve.proxy_patch): read it again
    # before moving to another Ray
    assert ray.__version__ == RAY_VERSION
    grpc, _ = serve_ports
    addrs = listening(grpc)
    assert addrs and addrs <= LOOPBACK, addrs  # no [::] (32 zeros) or 0.0.0.0
