"""`serve run deploy/serve_config.yaml` for real: the CLI, in a subprocess, against a
`ray start --head` cluster of its own, then one Generate call through the gRPC proxy.

The cluster gets its own temp dir and ports (other Ray clusters on the machine are left
alone; `ray stop` would kill them all) and is stopped through its `ray start --block`
process. The only edit to the served file: free ports instead of 9000/8000.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "cluster" / "models" / "demo"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The `ray`/`serve` CLI beside this Python, else on PATH (a venv over site packages)."""
    here = BIN / name
    return str(here) if here.exists() else (shutil.which(name) or str(here))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (DEMO / "target" / "config.json").exists(),
                                 reason="demo models not present (spec-cluster models train-demo)")]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(pred, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.5)
    return False


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head --block` in its own session; yields its GCS address."""
    gcs, client, dashboard, agent, agent_grpc, metrics, runtime_env = free_ports(7)
    temp_dir = tempfile.mkdtemp(prefix="rsr", dir="/tmp")  # unix socket paths must stay short
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           # Ray 2.60's `ray start` turns token auth on when ~/.ray/auth_token exists, and
           # `serve run` must then present the token: give both one of our own.
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    log = tmp_path / "ray_start.log"
    cmd = [tool("ray"), "start", "--head", "--block", f"--temp-dir={temp_dir}", f"--port={gcs}",
           f"--ray-client-server-port={client}", f"--dashboard-port={dashboard}",
           f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={runtime_env}", "--include-dashboard=false", "--num-cpus=4",
           "--disable-usage-stats"]
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if not wait_for(lambda: "Ray runtime started" in log.read_text(), 90, head):
            pytest.fail(f"ray start failed\n{log.read_text()[-3000:]}")
        yield f"127.0.0.1:{gcs}", env
    finally:
        head.send_signal(signal.SIGTERM)  # --block: stops the processes it started
        try:
            head.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of its session is left
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_serve_run_config_file_serves_generate(ray_head, tmp_path):
    from cluster.client import Client

    address, env = ray_head
    grpc_port, http_port = free_ports(2)
    doc = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    doc["grpc_options"]["port"], doc["http_options"]["port"] = grpc_port, http_port
    config = tmp_path / "serve_config.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))

    log = tmp_path / "serve_run.log"
    with open(log, "w") as out:  # cwd elsewhere: the inline config needs no files
        run = subprocess.run([tool("serve"), "run", "--non-blocking", "--address", address, str(config)],
                             cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    assert run.returncode == 0, log.read_text()[-3000:]

    client = Client(f"localhost:{grpc_port}", timeout=10)
    result = {}

    def generated() -> bool:
        try:
            result["r"] = client.generate("def foo(", max_tokens=8)
            return True
        except Exception as e:  # proxy up before the app, or replicas still starting
            result["error"] = e
            return False

    try:
        if not wait_for(generated, 150):
            pytest.fail(f"no Generate answer after 150 s: {result.get('error')!r}")
        r = result["r"]
        assert r.token_ids and r.finish_reason in ("length", "stop")
        assert client.health() == "SERVING"
    finally:
        client.close()
