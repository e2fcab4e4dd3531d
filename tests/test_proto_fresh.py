"""The committed code in cluster/proto must match a fresh protoc run."""

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from cluster.proto import gen  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh():
    result = subprocess.run(
        [sys.executable, "-m", "cluster.proto.gen", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_reports_stale_code(tmp_path, monkeypatch):
    for name in gen.GENERATED:
        shutil.copy(gen.OUT_DIR / name, tmp_path / name)
    stale = tmp_path / "generation_pb2.py"
    stale.write_text(stale.read_text().replace("DO NOT EDIT", "edited", 1))
    monkeypatch.setattr(gen, "OUT_DIR", tmp_path)
    assert gen.main(["--check"]) == 1
    (tmp_path / "generation_pb2.pyi").unlink()
    fresh = gen.generate()
    stale_files = {diff.splitlines()[0] for diff in gen.check(fresh)}
    assert stale_files == {"--- committed/generation_pb2.py", "--- committed/generation_pb2.pyi"}


def test_generated_code_imports_as_a_package():
    from cluster.proto import generation_pb2 as pb
    from cluster.proto import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(prompt="hi", temperature=0.0)
    assert request.HasField("temperature") and not request.HasField("top_p")
    assert pb_grpc.GenerationStub.__module__ == "cluster.proto.generation_pb2_grpc"


def test_messages_pickle_by_their_real_module():
    # Ray pickles deployment classes and requests; a message class whose
    # __module__ is protoc's "speccluster.v1.generation_pb2" cannot be found.
    from cluster.proto import generation_pb2 as pb

    assert pb.GenerateRequest.__module__ == "cluster.proto.generation_pb2"
    request = pb.GenerateRequest(prompt="hi", seed=7, stop=["\n"])
    assert pickle.loads(pickle.dumps(request)) == request
