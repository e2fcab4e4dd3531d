"""deploy/serve_config.yaml and the serveConfigV2 patches: fresh (what cluster.deploy_config
writes now), valid for Ray Serve, and equivalent to the typed configs they come from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster import deploy_config
from cluster.config import load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["configs/cluster.yaml", "configs/hopper.yaml", "configs/hopper-70b.yaml"]


def test_committed_files_are_fresh(capsys):
    assert deploy_config.main(["--check"]) == 0, capsys.readouterr().err


def test_check_fails_on_a_stale_or_missing_file(tmp_path, capsys):
    out = tmp_path / "serve_config.yaml"
    args = ["--config", "configs/cluster.yaml", "--out", str(out)]
    assert deploy_config.main(args + ["--check"]) == 1  # missing
    assert deploy_config.main(args) == 0
    assert deploy_config.main(args + ["--check"]) == 0
    out.write_text(out.read_text().replace("max_num_seqs: 32", "max_num_seqs: 33"))
    assert deploy_config.main(args + ["--check"]) == 1
    assert "max_num_seqs: 33" in capsys.readouterr().err  # the diff says what drifted


def test_bad_config_fails_without_writing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {max_num_seqs: 0}\n")
    out = tmp_path / "out.yaml"
    assert deploy_config.main(["--config", str(bad), "--out", str(out)]) == 2
    assert not out.exists()


def test_serve_config_file_is_a_serve_deploy_schema():
    from ray.serve.schema import ServeDeploySchema

    from cluster.serve.app import SERVICERS

    doc = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    assert schema.grpc_options.port == 9000
    assert schema.grpc_options.grpc_servicer_functions == SERVICERS
    assert schema.http_options.port == 8000 and schema.http_options.host == "127.0.0.1"  # network.host
    [app] = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("spec-cluster", "/", deploy_config.IMPORT_PATH)
    assert [d.name for d in app.deployments] == ["Router", "Verifier", "Drafter"]


@pytest.mark.parametrize("path", CONFIGS)
def test_inline_args_rebuild_the_config(path):
    """What the builder gets on the cluster is the file's config, less the two local-only
    fields (the autoscaling file goes into the deployment entries)."""
    cfg = load_config(REPO / path)
    doc = yaml.safe_load(deploy_config.render(path))
    rebuilt = parse_config(doc["applications"][0]["args"]["cluster"])
    url = None if cfg.kvdir.url == "embedded" else cfg.kvdir.url
    expected = cfg.model_copy(update={"autoscaling_file": None,
                                      "kvdir": cfg.kvdir.model_copy(update={"url": url})})
    assert rebuilt == expected


@pytest.mark.parametrize("path", CONFIGS)
def test_deployment_entries_are_what_the_config_asks_for(path):
    """Replicas, autoscaling and resources of each entry, checked against the typed config
    (independently of how deploy_config derives them)."""
    from cluster.policy.config import load_autoscaling

    cfg = load_config(REPO / path)
    entries = {d["name"]: d for d in yaml.safe_load(deploy_config.render(path))["applications"][0]["deployments"]}
    scaling = load_autoscaling(REPO / cfg.autoscaling_file) if cfg.autoscaling_file else None
    for name, section in (("Verifier", cfg.verifier), ("Drafter", cfg.drafter)):
        e = entries[name]
        want = {"num_cpus": 1, **section.ray_actor_options}
        if name == "Verifier" and cfg.engine.tensor_parallel_size > 1 and section.ray_actor_options.get("num_gpus"):
            # rank 0 sees every GPU of the node, as its followers do (cluster.serve.followers)
            want["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        assert e["ray_actor_options"] == want
        assert e["max_ongoing_requests"] == section.max_ongoing_requests
        if section.autoscaling and scaling:
            policy = getattr(scaling, name.lower()).serve_autoscaling_config()
            assert e["autoscaling_config"] == policy and "num_replicas" not in e
        else:
            assert e["num_replicas"] == section.num_replicas and "autoscaling_config" not in e
    assert entries["Router"]["max_ongoing_requests"] == 2 * cfg.router.max_inflight


def test_an_empty_config_gives_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    doc = deploy_config.serve_config(parse_config({}))
    ServeDeploySchema.model_validate(doc)
    assert parse_config(doc["applications"][0]["args"]["cluster"]).kvdir.url != "embedded"


@pytest.mark.parametrize("tp,actor,rank0,follower", [
    (1, {"num_cpus": 1}, None, None),
    (2, {"num_cpus": 1}, {"CPU": 1}, {"CPU": 1}),
    (4, {"num_cpus": 3, "memory": 2**30}, {"CPU": 3, "memory": 2**30}, {"CPU": 1}),
    (8, {"num_gpus": 1, "num_cpus": 4, "accelerator_type": "H100"},
     {"CPU": 4, "GPU": 1, "accelerator_type:H100": 0.001}, {"CPU": 1, "GPU": 1, "accelerator_type:H100": 0.001})])
def test_a_tensor_parallel_verifier_reserves_its_devices_as_one_placement_group(tp, actor, rank0, follower):
    """N bundles on one node: rank 0's (the replica's own resources: Serve places the replica in
    bundle 0) and one device's worth per follower; none for one rank. Router and Drafter never."""
    cfg = parse_config({"engine": {"tensor_parallel_size": tp}, "verifier": {"ray_actor_options": actor}})
    entries = {d["name"]: d for d in deploy_config.deployment_entries(cfg)}
    v = entries["Verifier"]
    if tp == 1:
        assert "placement_group_bundles" not in v and "placement_group_strategy" not in v
    else:
        assert v["placement_group_bundles"] == [rank0] + [follower] * (tp - 1)
        assert v["placement_group_strategy"] == "STRICT_PACK"
    assert not any("placement_group_bundles" in entries[n] for n in ("Router", "Drafter"))


def test_colocated_placement_has_no_drafter_entry():
    names = [d["name"] for d in deploy_config.deployment_entries(parse_config({"placement": "colocated"}))]
    assert names == ["Router", "Verifier"]


def test_hopper_verifier_uses_rays_h100_accelerator_name():
    from ray.util.accelerators import NVIDIA_H100

    cfg = load_config(REPO / "configs" / "hopper.yaml")
    assert cfg.verifier.ray_actor_options["accelerator_type"] == NVIDIA_H100
    assert cfg.verifier.ray_actor_options["num_gpus"] == 1
    assert (cfg.models.dtype, cfg.models.attention) == ("bfloat16", "fa3")


def test_hopper_drafter_drafts_on_a_hopper_gpu():
    """A 1B draft step on CPU costs many verify steps (configs/hopper.yaml): the model
    drafter gets a GPU (a slice or a whole one) of the verifier's kind."""
    from ray.util.accelerators import NVIDIA_H100

    cfg = load_config(REPO / "configs" / "hopper.yaml")
    assert (cfg.placement, cfg.models.drafter) == ("disaggregated", "model")
    assert cfg.drafter.ray_actor_options.get("num_gpus", 0) > 0
    assert cfg.drafter.ray_actor_options["accelerator_type"] == NVIDIA_H100
