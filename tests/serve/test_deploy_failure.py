"""A deployment that cannot start: `spec-cluster up` exits 1 with one line that names the failed
deployment and its replica's own error (Serve's message names only the deployment), and no
ready line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.bench.served import free_ports

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_a_replica_that_cannot_start_is_named_with_its_error(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(REPO / "cluster/models/demo/target", target)
    config = json.loads((target / "config.json").read_text())
    config["num_attention_heads"] = 3  # a hidden size of 256 does not split over 3 heads
    (target / "config.json").write_text(json.dumps(config))
    grpc_port, http_port = free_ports(2)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models: {{target: {target}, draft: null, drafter: ngram}}\nkvdir: {{url: null}}\n"
                   f"network: {{grpc_port: {grpc_port}, http_port: {http_port}}}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "RAY_ADDRESS": ""}
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "up", "--config", str(cfg)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 1 and "spec-cluster ready" not in r.stdout, r
    errors = [line for line in r.stderr.splitlines() if line.startswith("spec-cluster: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "Deploying application spec-cluster failed" in errors[0]
    # whichever deployment's replica failed first (each loads the target's config): named with its error
    assert re.search(r"(Router|Verifier|Drafter): ValueError", errors[0]), errors[0]
    assert "ValueError: The hidden size (256) is not a multiple of the number of attention heads (3)" in errors[0]
