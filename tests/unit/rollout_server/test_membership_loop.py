"""The rollout server's membership loop: it registers with the learner, beats, registers again when
the learner forgot it, and does not register while its vLLM engine is dead (it is about to exit, and
a learner that counted it would wait on it when forming the next weight-transfer group)."""

import asyncio
import logging
from types import SimpleNamespace

from rlmesh.rollout_server import server
from rlmesh.v1 import learner_pb2


class _Learner:
    """Records the calls; its Heartbeat says the server is forgotten once, on the first beat."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def RegisterGenerator(self, request):
        self.calls.append("register")
        return learner_pb2.RegisterGeneratorResponse(version=request.version)

    async def Heartbeat(self, request):
        self.calls.append("beat")
        return learner_pb2.HeartbeatResponse(registered=self.calls.count("beat") > 1, heartbeat_interval_s=0.01)


def _run(engine_errored: bool, seconds: float, enough: int = 0) -> list[str]:
    """Runs the loop for `seconds`, or until the learner has seen `enough` calls (a CI machine
    building images beside the tests can take far longer than the 10 ms beats ask for)."""

    async def go() -> list[str]:
        learner = _Learner()

        async def not_recovering() -> bool:
            return False

        generator = SimpleNamespace(engine=SimpleNamespace(errored=engine_errored), version=0,
                                    recover_from_lost_learner=not_recovering)
        worker = SimpleNamespace(ready=asyncio.Event(), num_inflight=0)
        task = asyncio.ensure_future(server.keep_membership(learner, "rollout-0", "127.0.0.1:1", worker, generator,
                                                            logging.getLogger("test")))
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline and not (enough and len(learner.calls) >= enough):
            await asyncio.sleep(0.01)
        task.cancel()
        return learner.calls

    return asyncio.run(go())


def test_a_live_server_registers_beats_and_registers_again_when_forgotten(monkeypatch):
    monkeypatch.setattr(server, "HEARTBEAT_S", 0.01)  # until the first beat's reply sets the interval
    calls = _run(engine_errored=False, seconds=30.0, enough=4)
    assert calls[:4] == ["register", "beat", "register", "beat"], calls


def test_a_server_whose_engine_died_does_not_register():
    assert _run(engine_errored=True, seconds=1.5) == []
