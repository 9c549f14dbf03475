"""The built-in `reasoning_gym` environment through a real reward server on a real gRPC port: held-out
examples from `data.type: reasoning_gym` travel as env_metadata (a protobuf Struct) and come back
scored by reasoning-gym's own scorer (in the reward server's worker processes); an unknown dataset and
a malformed entry are item errors beside the scored items of the same call (a scorer that raises:
tests/unit/reward_server/test_reasoning_gym.py)."""

import pytest
from google.protobuf.struct_pb2 import Struct

from rlmesh.learner.data.sources import load_dataset
from rlmesh.reward_server.service import RewardService
from rlmesh.services.config import ReasoningGymDataSection
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.integration


def _item(i: str, completion: str, metadata: dict) -> reward_pb2.ScoreItem:
    struct = Struct()
    struct.update(metadata)
    return reward_pb2.ScoreItem(id=i, env_name="reasoning_gym", completion=completion, env_metadata=struct)


@pytest.mark.asyncio(loop_scope="session")
async def test_reasoning_gym_items_are_scored_over_grpc():
    _, evals = load_dataset(ReasoningGymDataSection(dataset="leg_counting", settings={"max_animals": 3},
                                                    num_train=4, num_eval=2), seed=0)
    service = RewardService()  # every built-in, as `rlmesh reward` serves them
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                  "rlmesh.v1.RewardService")], port=0)
    try:
        async with make_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            envs = {e.name: e.kind for e in (await stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest())).environments}
            assert envs["reasoning_gym"] == "single_turn"
            first, second = evals[0].metadata, evals[1].metadata
            items = [_item("right", f"Counting.\n<answer>{first['answer']}</answer>", first),
                     _item("wrong", f"<answer>{int(second['answer']) + 1}</answer>", second),
                     _item("untagged", str(first["answer"]), first),
                     _item("unknown", "<answer>1</answer>", {**first, "dataset": "no_such_task"}),
                     _item("malformed", "<answer>1</answer>", {**first, "entry": "{"})]
            reply = await stub.Score(reward_pb2.ScoreRequest(items=items), timeout=60)
            workers = service.local["reasoning_gym"].workers.status()
    finally:
        await server.stop(0)
        service.local["reasoning_gym"].close()
    assert workers.num_workers >= 1 and workers.num_replaced == 0
    by_id = {r.id: r for r in reply.results}
    assert (by_id["right"].reward, by_id["right"].components["correct"]) == (1.0, 1.0)
    assert not by_id["right"].error and by_id["right"].components["format"] == 1.0
    assert (by_id["wrong"].reward, by_id["wrong"].components["correct"]) == (0.0, 0.0)
    assert by_id["untagged"].reward == 0.0 and by_id["untagged"].components["format"] == 0.0
    assert by_id["unknown"].error == "reasoning_gym: metadata.dataset='no_such_task' is not a reasoning-gym dataset"
    assert by_id["malformed"].error.startswith("reasoning_gym: metadata.entry is not JSON")
