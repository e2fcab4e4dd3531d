"""`spec-cluster up` in a child process for a benchmark or a smoke check: the endpoint a user
runs, on free ports, stopped with Ctrl-C's signal when done."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Served:
    grpc: str          # host:port
    http: str          # the OpenAI API's base URL
    ready_s: float     # from the process's start to its ready line


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def served(config: dict, echo=print, timeout_s: float = 300):
    """Serve `config` (a cluster config dict; network ports are chosen here) until the block ends."""
    import yaml

    grpc_port, http_port = free_ports(2)
    path = Path(tempfile.mkdtemp()) / "served.yaml"
    path.write_text(yaml.safe_dump({**config, "network": {**config.get("network", {}), "grpc_port": grpc_port,
                                                          "http_port": http_port}}))
    t = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        ready = False
        for line in proc.stdout:
            echo("  up: " + line.rstrip())
            if "spec-cluster ready" in line:
                ready = True
                break
        timer.cancel()
        if not ready or proc.poll() is not None:  # its output ended first: it exited (or was killed)
            raise RuntimeError(f"spec-cluster up exited with {proc.wait()} before it was ready")
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep its pipe drained
        yield Served(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/v1", time.time() - t)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
