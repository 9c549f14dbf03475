"""The weight wire layout and the transports' learner-side behaviour that needs no peers."""

import time

import pytest

torch = pytest.importorskip("torch")

from rlmesh.services.config import WeightSyncSection  # noqa: E402
from rlmesh.services.weights.base import build_transport  # noqa: E402
from rlmesh.services.weights.wire import buckets, describe, flat_buckets, weights_digest  # noqa: E402


def _named():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g)),
            ("c", torch.randint(0, 9, (2, 2), generator=g)), ("d", torch.randn(2, generator=g))]


def test_buckets_are_dtype_homogeneous_runs_in_order():
    metas = describe(_named())
    assert buckets(metas) == [[0, 1], [2], [3]]
    assert buckets(metas, bucket_bytes=48) == [[0], [1], [2], [3]]


def test_streamed_flattening_equals_the_whole_list_and_digest():
    named = _named()
    metas = describe(named)
    streamed = list(flat_buckets(iter(named), metas))  # a generator: nothing materialised up front
    assert [t.numel() for t in streamed] == [17, 4, 2]
    assert torch.equal(streamed[0][:12], named[0][1].reshape(-1))
    assert weights_digest(iter(named), metas) == weights_digest(named)


def test_a_stream_out_of_layout_order_is_refused():
    named = _named()
    with pytest.raises(ValueError, match="out of order"):
        list(flat_buckets(iter([named[1], named[0], *named[2:]]), describe(named)))


def test_gloo_verify_reports_a_missing_digest_instead_of_waiting_forever():
    transport = build_transport(WeightSyncSection(backend="gloo", timeout_s=5))
    t0 = time.monotonic()
    problem = transport.verify(epoch=1, version=3, digest="ab" * 32, ranks=[1], timeout_s=0.5)
    assert "rank 1 published no digest for v3" in problem
    assert time.monotonic() - t0 < 3


def test_gloo_verify_compares_what_workers_published():
    from rlmesh.services.weights.gloo import digest_key

    transport = build_transport(WeightSyncSection(backend="gloo", timeout_s=5))
    transport.store.set(digest_key(1, 3, 1), "ab" * 32)
    transport.store.set(digest_key(1, 3, 2), "cd" * 32)
    assert transport.verify(1, 3, "ab" * 32, [1], 1.0) == ""
    assert "rank 2 received weights v3 with digest cdcdcd" in transport.verify(1, 3, "ab" * 32, [2], 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on hosts without CUDA")
def test_nccl_transport_without_cuda_says_how_to_fix_it():
    with pytest.raises(ValueError, match="weight_sync.backend=gloo"):
        build_transport(WeightSyncSection(backend="nccl"))


def test_nccl_worker_payloads_match_vllms_engine():
    """The dicts the rollout server hands vLLM's `nccl` engine parse into its own dataclasses."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    from rlmesh.services.weights.nccl import worker_init_info, worker_update_info

    init = NCCLWeightTransferInitInfo(**worker_init_info("10.0.0.1", 29555, 1, 3))
    assert (init.rank_offset, init.world_size, init.packed) == (1, 3, True)
    update = NCCLWeightTransferUpdateInfo(**worker_update_info(describe(_named())))
    assert update.names == ["a", "b", "c", "d"] and update.shapes[0] == [3, 4] and update.dtype_names[2] == "int64"


def test_gloo_send_and_receive_over_several_buckets_keep_bytes_order_and_digest():
    """A real two-rank gloo group on loopback (the receiver on a thread): with two buckets in flight
    on both sides, every tensor arrives intact, in order, and both digests equal the wire digest."""
    import hashlib
    import threading

    from rlmesh.services.weights.gloo import join_group, receive

    named = _named() + [("e", torch.randn(7, 3)), ("f", torch.arange(5)), ("g", torch.randn(4))]
    metas = describe(named)
    assert len(buckets(metas)) == 5
    transport = build_transport(WeightSyncSection(backend="gloo", timeout_s=30))
    got, digest = [], hashlib.sha256()

    def worker():
        _, group = join_group("127.0.0.1", transport.store.port, 1, 2, epoch=7, timeout_s=30)
        got.extend((name, t.clone()) for name, t in receive(group, metas, digest))

    thread = threading.Thread(target=worker)
    thread.start()
    transport.form_group(epoch=7, world_size=2)
    sent = transport.send(iter(named), metas)
    thread.join(30)
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named))
    assert sent == digest.hexdigest() == weights_digest(named)
