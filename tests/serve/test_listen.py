"""What the default config listens on: the HTTP and gRPC proxies on loopback only
(network.host), read from the kernel's table of listening sockets and the proxy process's open
sockets, not from our config."""

import os
from pathlib import Path

import pytest


def _listening(port: int) -> dict[str, str]:
    """Socket inode -> local address (hex, as /proc/net/tcp{,6} give them) of each socket
    listening on `port`."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            addr, _, p = fields[1].rpartition(":")
            if fields[3] == "0A" and int(p, 16) == port:  # 0A: LISTEN
                out[fields[9]] = addr
    return out


# 127.0.0.1, as IPv4 and as IPv4-mapped IPv6 (gRPC's dual-stack socket), and ::1 (hex, as
# /proc/net/tcp{,6} give them)
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}

ANY = {"00000000", "00000000000000000000000000000000", "0000000000000000FFFF000000000000"}  # 0.0.0.0, [::]


def listening(port: int) -> set[str]:
    """Local addresses the process serving `port` listens on there: that of each process
    listening on it at loopback or at any address. Another process may hold the same port
    number at another address (a Ray worker's server on the node's IP); it is not counted."""
    socks = _listening(port)
    serving = [held for held in _owners(set(socks)).values() if any(socks[i] in LOOPBACK | ANY for i in held)]
    return {socks[i] for held in serving for i in held}


def _owners(inodes: set[str]) -> dict[int, set[str]]:
    """pid -> which of these socket inodes it holds open."""
    out: dict[int, set[str]] = {}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            held = {link[8:-1] for f in fd_dir.iterdir() if (link := os.readlink(f)).startswith("socket:[")}
        except OSError:  # the process ended, or is not ours to read
            continue
        if held & inodes:
            out[int(fd_dir.parent.name)] = held & inodes
    return out


def proxy_listening(serve_ports) -> tuple[set[str], set[str]]:
    """The addresses Serve's proxy listens on, gRPC and HTTP: those of the one process that
    listens on both ports. Another process may listen on one of the same port numbers at
    another address (a Ray worker's server on the node's IP took one once); it is not the
    proxy."""
    grpc, http = (_listening(p) for p in serve_ports)
    owners = _owners(set(grpc) | set(http))
    proxy = [pid for pid, held in owners.items() if held & set(grpc) and held & set(http)]
    assert len(proxy) == 1, (grpc, http, owners)
    held = owners[proxy[0]]
    return {a for i, a in grpc.items() if i in held}, {a for i, a in http.items() if i in held}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_default_http_proxy_listens_on_loopback_only(serve_ports):
    _, addrs = proxy_listening(serve_ports)
    assert addrs == {"0100007F"}, addrs  # 127.0.0.1, little-endian hex; no 0.0.0.0 (00000000) or [::]



@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_default_grpc_proxy_listens_on_loopback_only(serve_ports):
    import ray

    from cluster.serve.proxy_patch import RAY_VERSION

    # the bind address is a patch of Ray's proxy (cluster.serve.proxy_patch): read it again
    # before moving to another Ray
    assert ray.__version__ == RAY_VERSION
    addrs, _ = proxy_listening(serve_ports)
    assert addrs and addrs <= LOOPBACK, addrs  # no [::] (32 zeros) or 0.0.0.0
