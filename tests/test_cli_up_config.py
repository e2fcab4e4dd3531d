"""`spec-cluster up --config` refuses a bad speculation policy before Ray starts, with one
line naming the field; `speculation:` may also name a policy file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
OVERLAP = ("speculation:\n  mode: table\n  table:\n"
           "    - {min_concurrency: 0, max_concurrency: 8, gamma: 4}\n"
           "    - {min_concurrency: 8, max_concurrency: 16, gamma: 2}\n")


@pytest.mark.parametrize("text, names", [
    ("speculation:\n  mode: turbo\n", ["speculation.mode", "turbo"]),
    ("speculation:\n  mode: fixed\n  gamma: -1\n", ["speculation.gamma", "-1"]),
    (OVERLAP, ["speculation", "table[1].min_concurrency", "overlaps"]),
    ("speculation:\n  mode: table\n  table:\n    - {min_concurrency: 0, max_concurrency: 8, gamma: -2}\n",
     ["speculation.table[0].gamma"]),
], ids=["unknown-mode", "negative-gamma", "overlapping-ranges", "negative-row-gamma"])
def test_up_refuses_bad_policy_before_ray(tmp_path, text, names):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "RAY_ADDRESS": ""}
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "up", "--config", str(cfg)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"spec-cluster: error: {cfg}: field ")
    for name in names:
        assert name in lines[0], lines[0]
    assert "ready" not in r.stdout
    assert time.monotonic() - t < 30  # no Ray start (that alone takes longer here)


def test_speculation_may_name_a_policy_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"speculation: {REPO / 'configs/policy/goodput.yaml'}\n")
    spec = load_config(cfg).speculation
    assert spec.mode == "goodput" and spec.gamma_max == 8


def test_bad_policy_file_is_named(tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("mode: goodput\ngamma: -3\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"speculation: {policy}\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    msg = str(e.value)
    assert f"{cfg}: field 'speculation': {policy}: field 'gamma'" in msg
    cfg.write_text("speculation: nope.yaml\n")
    with pytest.raises(ConfigError, match="nope.yaml: cannot read"):
        load_config(cfg)


def test_up_refuses_an_open_host_without_keys_before_ray(tmp_path):
    cfg = tmp_path / "open.yaml"
    cfg.write_text("network:\n  host: 0.0.0.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "RAY_ADDRESS": ""}
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "up", "--config", str(cfg)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "ready" not in r.stdout, r
    assert r.stderr.strip().splitlines() == [
        "spec-cluster: error: network.host 0.0.0.0 serves generation to other hosts and no API keys are set: "
        "set router.api_keys or router.api_keys_env, or pass --insecure"]


@pytest.mark.parametrize("address, port, env, want", [
    (None, None, None, "localhost:9000"),
    (None, 9611, None, "localhost:9611"),
    ("gpu-box:9100", None, None, "gpu-box:9100"),
    ("gpu-box", None, None, "gpu-box:9000"),
    ("gpu-box:9100", 9611, None, "gpu-box:9611"),
    (None, None, "env-box:7000", "env-box:7000"),
    (None, 9611, "env-box:7000", "env-box:9611"),
    ("[::1]:9100", None, None, "[::1]:9100"),
    ("[::1]", 9611, None, "[::1]:9611"),
])
def test_a_server_is_named_by_address_port_or_env(monkeypatch, address, port, env, want):
    from cluster.cli import _parser
    from cluster.client import ADDRESS_ENV, server_address

    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    if env:
        monkeypatch.setenv(ADDRESS_ENV, env)
    args = ["generate", "x"] + (["--address", address] if address else []) + (["--port", str(port)] if port else [])
    parsed = _parser().parse_args(args)  # generate takes --port as up does
    assert server_address(parsed.address, parsed.port) == want
