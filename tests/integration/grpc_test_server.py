"""A tiny RewardService on the shared plumbing, for the gRPC plumbing tests: Score sleeps for
metadata.sleep seconds before answering. Args: TOKEN [PORT] (default: a free port, printed)."""

import asyncio
import sys

import uvloop
from google.protobuf.json_format import MessageToDict

from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.services.grpc_server import start_server


class SlowReward(reward_pb2_grpc.RewardServiceServicer):
    async def Score(self, request, context):
        for item in request.items:
            await asyncio.sleep(float(MessageToDict(item.env_metadata).get("sleep", 0)))
        return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(id=i.id, reward=1.0) for i in request.items])


async def main(token: str, port: int) -> None:
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, SlowReward(),
                                  "rlmesh.v1.RewardService")], port=port, token=token)
    print(server.port, flush=True)
    await server.serve_forever(grace_s=10.0)
    print("drained", flush=True)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
