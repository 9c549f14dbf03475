import filecmp
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_generated_code_is_up_to_date(tmp_path):
    protos = sorted((REPO / "proto/rlmesh/v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO / "proto"),
                    f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    *map(str, protos)], check=True)
    generated = sorted(p.name for p in (tmp_path / "rlmesh/v1").iterdir())
    assert generated, "protoc produced nothing"
    stale = [name for name in generated
             if not filecmp.cmp(tmp_path / "rlmesh/v1" / name, REPO / "proto/rlmesh/v1" / name, shallow=False)]
    assert not stale, f"generated code is stale, run scripts/gen_proto.sh: {stale}"


def test_contracts_and_config_import_without_heavy_deps():
    code = (
        "import sys\n"
        "import rlmesh.v1.common_pb2, rlmesh.v1.rollout_pb2_grpc, rlmesh.v1.reward_pb2_grpc, rlmesh.v1.learner_pb2_grpc\n"
        "import rlmesh.services.config, rlmesh.services.queue, rlmesh.services.grpc_server, rlmesh.services.grpc_client, rlmesh.cli\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_sample_round_trips():
    from rlmesh.v1 import common_pb2

    sample = common_pb2.Sample(index=3, completion=common_pb2.TokenSequence(token_ids=[1, 2], loss_mask=[True, False]),
                               logprobs=[-0.5, 0.0], min_version=4, max_version=5, reward=1.0)
    again = common_pb2.Sample.FromString(sample.SerializeToString())
    assert list(again.completion.token_ids) == [1, 2] and list(again.completion.loss_mask) == [True, False]
    assert (again.min_version, again.max_version) == (4, 5)
