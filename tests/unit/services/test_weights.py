"""The weight wire layout, the transport factory and both sides of each transport (gloo over a real
two-rank group on loopback)."""

import pytest

torch = pytest.importorskip("torch")

from rlmesh.services.config import WeightSyncSection  # noqa: E402
from rlmesh.services.weights import build_receiver, build_sender  # noqa: E402
from rlmesh.services.weights.wire import Snapshot, buckets, describe, flat_buckets, weights_digest  # noqa: E402


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


def test_a_snapshot_is_the_wire_layout_copied_into_buffers_reused_across_updates():
    named, snapshot = _named(), Snapshot()
    metas = describe(named)
    first = snapshot.take(iter(named), metas)
    assert [torch.equal(a, b) for a, b in zip(first, flat_buckets(named, metas))] == [True] * 3
    pointers = [t.data_ptr() for t in first]
    with torch.no_grad():
        named[0][1].add_(1)  # the source changes after the copy: the snapshot does not
    assert not torch.equal(first[0][:12], named[0][1].reshape(-1))
    again = snapshot.take(iter(named), metas)
    assert [t.data_ptr() for t in again] == pointers and torch.equal(again[0][:12], named[0][1].reshape(-1))
    with pytest.raises(ValueError, match="out of order"):
        snapshot.take(iter([named[1], named[0], *named[2:]]), metas)
    with pytest.raises(ValueError, match="more tensors than the layout"):
        snapshot.take(iter([*named, ("e", torch.zeros(1))]), metas)


def test_a_stream_out_of_layout_order_is_refused():
    named = _named()
    with pytest.raises(ValueError, match="out of order"):
        list(flat_buckets(iter([named[1], named[0], *named[2:]]), describe(named)))


def _init_request(**overrides):
    from rlmesh.v1 import rollout_pb2

    fields = dict(backend="gloo", master_address="127.0.0.1", master_port=29555, rank_offset=1, world_size=2,
                  group_epoch=3, timeout_seconds=30, group_prefix="rlmesh/ab12/epoch3", group_secret=b"s" * 32)
    return rollout_pb2.InitWeightTransferRequest(**{**fields, **overrides})


def test_one_factory_builds_both_sides_of_a_transport():
    from rlmesh.services.weights import _transport, gloo

    cfg = WeightSyncSection(backend="gloo", timeout_s=5)
    sender, receiver = build_sender(cfg), build_receiver(cfg)
    assert isinstance(sender, gloo.GlooSender) and isinstance(receiver, gloo.GlooReceiver)
    assert sender.engine == receiver.engine == gloo.ENGINE and sender.verifies
    with pytest.raises(ValueError, match="weight_sync.backend='tcp'; choose gloo or nccl"):
        _transport("tcp")


def _listeners(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port`, read from the kernel's own tables."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add("127.0.0.1" if address == "0100007F" else address if width == 32 else
                          ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_gloo_store_listens_only_on_the_master_address_interface():
    sender = build_sender(WeightSyncSection(backend="gloo", master_address="127.0.0.1", timeout_s=5))
    assert _listeners(sender.store.port) == {"127.0.0.1"}  # not 0.0.0.0 / [::] as TCPStore alone would


def test_gloo_store_on_an_address_that_is_not_local_says_which_key_to_set():
    with pytest.raises(ValueError, match="weight_sync.bind_address"):
        build_sender(WeightSyncSection(backend="gloo", master_address="192.0.2.1", timeout_s=5))  # TEST-NET-1


def test_each_group_gets_a_fresh_random_prefix_and_secret():
    sender = build_sender(WeightSyncSection(backend="gloo", timeout_s=5))
    first, again, second = sender.rendezvous(1), sender.rendezvous(1), sender.rendezvous(2)
    assert (first.master_address, first.master_port) == ("127.0.0.1", sender.store.port)
    assert len({first.prefix, again.prefix, second.prefix}) == 3 and len({first.secret, again.secret}) == 2
    assert first.prefix.endswith("/epoch1") and len(first.secret) == 32 and first.nccl_unique_id == b""


def test_a_gloo_senders_store_keeps_its_listener_after_the_sender_and_its_predecessors_are_collected():
    """The store owns the listening descriptor: collecting a sender (or one made before) never closes
    a number that a live store listens on (a double close once hung a group's rendezvous in CI)."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    for _ in range(3):
        build_sender(WeightSyncSection(backend="gloo", timeout_s=5))  # made and dropped at once
        gc.collect()
        store = build_sender(WeightSyncSection(backend="gloo", timeout_s=5)).store  # the sender itself is dropped
        gc.collect()
        client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=5))
        client.set("reached", "yes")
        assert store.get("reached") == b"yes"


def test_gloo_receiver_turns_init_into_the_engine_payload_and_refuses_foreign_groups():
    receiver = build_receiver(WeightSyncSection(backend="gloo", timeout_s=5))
    info = receiver.init_info(_init_request())
    assert info["group_prefix"] == "rlmesh/ab12/epoch3" and bytes.fromhex(info["group_secret"]) == b"s" * 32
    assert (info["master_port"], info["rank_offset"], info["world_size"]) == (29555, 1, 2)
    with pytest.raises(PermissionError, match="weight_sync.master_address='127.0.0.1'"):
        receiver.init_info(_init_request(master_address="10.1.2.3"))
    with pytest.raises(ValueError, match="same weight_sync.backend"):
        receiver.init_info(_init_request(backend="nccl"))
    with pytest.raises(ValueError, match="rank_offset >= 1"):
        receiver.init_info(_init_request(rank_offset=0))
    with pytest.raises(ValueError, match="no group_prefix, or a group_secret under 16 bytes"):
        receiver.init_info(_init_request(group_secret=b""))
    fixed = build_receiver(WeightSyncSection(backend="gloo", store_port=29500, timeout_s=5))
    with pytest.raises(PermissionError, match="port 29500"):
        fixed.init_info(_init_request())


def test_gloo_receiver_digests_in_the_algorithm_the_update_names_and_sha256_when_it_names_none():
    from rlmesh.v1 import rollout_pb2

    receiver = build_receiver(WeightSyncSection(backend="gloo", timeout_s=5))
    assert receiver.digest_algorithms == ("blake3", "xxh3", "sha256")
    spec = [rollout_pb2.TensorSpec(name="w", dtype="float32", shape=[2])]
    old_learner = rollout_pb2.UpdateWeightsRequest(version=1, tensors=spec)  # predates digest_algorithm
    assert receiver.update_info(old_learner)["digest_algorithm"] == "sha256"
    new = rollout_pb2.UpdateWeightsRequest(version=1, tensors=spec, digest_algorithm="blake3")
    assert receiver.update_info(new)["digest_algorithm"] == "blake3"
    with pytest.raises(ValueError, match="digest_algorithm='md5'"):
        receiver.update_info(rollout_pb2.UpdateWeightsRequest(version=1, tensors=spec, digest_algorithm="md5"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on hosts without CUDA")
def test_nccl_transport_without_cuda_says_how_to_fix_it():
    with pytest.raises(ValueError, match="weight_sync.backend=gloo"):
        build_sender(WeightSyncSection(backend="nccl"))


def test_nccl_receiver_payloads_match_vllms_engine():
    """The dicts the rollout server hands vLLM's `nccl` engine parse into its own dataclasses; the
    unique id arrives as the bytes the learner sent (no store, nothing unpickled)."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    from rlmesh.v1 import rollout_pb2

    receiver = build_receiver(WeightSyncSection(backend="nccl"))
    unique_id = bytes(range(128))
    init = NCCLWeightTransferInitInfo(**receiver.init_info(_init_request(backend="nccl", world_size=3,
                                                                         nccl_unique_id=unique_id)))
    assert (init.rank_offset, init.world_size, init.packed) == (1, 3, True)
    assert init.nccl_unique_id_bytes == unique_id and init.master_address is None
    with pytest.raises(ValueError, match="nccl_unique_id has 0 bytes"):
        receiver.init_info(_init_request(backend="nccl"))
    specs = [rollout_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=m.shape) for m in describe(_named())]
    update = NCCLWeightTransferUpdateInfo(**receiver.update_info(rollout_pb2.UpdateWeightsRequest(tensors=specs)))
    assert update.names == ["a", "b", "c", "d"] and update.shapes[0] == [3, 4] and update.dtype_names[2] == "int64"


def _worker(sender, ticket, rank=1, world_size=2):
    """A worker on a thread joining `ticket`; returns (thread, outcome dict)."""
    import threading

    from rlmesh.services.weights.gloo import join_group

    outcome = {}

    def run():
        try:
            outcome["group"] = join_group(ticket, rank, world_size, timeout_s=15)
        except Exception as err:  # noqa: BLE001 - reported to the test
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("algorithm", ["blake3", "xxh3", "sha256"])
def test_gloo_send_and_receive_over_several_buckets_keep_bytes_order_and_digest(algorithm):
    """A real two-rank gloo group on loopback (the receiver on a thread): with two buckets in flight
    on both sides and each side digesting on its own side thread, every tensor arrives intact, in
    order, and both digests equal the wire digest in the agreed algorithm (and differ across
    algorithms). A second update lands in the same receive buffers, with the new bytes."""
    import threading

    from rlmesh.services.weights.gloo import receive
    from rlmesh.services.weights.wire import DIGEST_ALGORITHMS, BackgroundDigest, WireBuffers

    named = _named() + [("e", torch.randn(7, 3)), ("f", torch.arange(5)), ("g", torch.randn(4))]
    metas = describe(named)
    assert len(buckets(metas)) == 5
    sender = build_sender(WeightSyncSection(backend="gloo", timeout_s=30))
    thread, outcome = _worker(sender, sender.rendezvous(7))
    sender.form_group(epoch=7, world_size=2)
    thread.join(30)
    buffers, pointers = WireBuffers(), []
    for round_ in range(2):
        got, digest = [], BackgroundDigest(algorithm)
        receiver = threading.Thread(target=lambda: got.extend(
            (name, t.clone()) for name, t in receive(outcome["group"], metas, digest, into=buffers)))
        receiver.start()
        sent = sender.send(iter(named), metas, algorithm)
        receiver.join(30)
        assert [n for n, _ in got] == [n for n, _ in named]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named))
        assert sent == digest.hexdigest() == weights_digest(named, algorithm=algorithm)
        pointers.append([t.data_ptr() for t in buffers.flats])
        with torch.no_grad():
            named[0][1].add_(1)  # the next round sends other bytes
    assert pointers[0] == pointers[1]
    assert len({weights_digest(named, algorithm=a) for a in DIGEST_ALGORITHMS}) == len(DIGEST_ALGORITHMS)


def test_a_snapshot_hands_each_bucket_over_as_soon_as_it_is_copied():
    """The sender iterates the hand-off while the copy runs: each bucket arrives in order, fully
    copied; a copy that fails part-way ends the sender's iteration with that error."""
    from rlmesh.services.weights.wire import Handoff

    named, snapshot = _named(), Snapshot()
    metas = describe(named)
    handoff, seen = Handoff(), []
    snapshot.take(iter(named), metas, ready=lambda flat: seen.append((flat.clone(), handoff.put(flat))))
    handoff.end()
    got = list(handoff)
    assert [torch.equal(a, b) for a, b in zip(got, flat_buckets(named, metas))] == [True] * 3
    assert [torch.equal(a, b) for (a, _), b in zip(seen, got)] == [True] * 3  # complete when handed over

    handoff = Handoff()
    with pytest.raises(ValueError, match="out of order"):
        snapshot.take(iter([named[0], named[1], named[3], named[2]]), metas, ready=handoff.put)
    handoff.end(ValueError("out of order"))
    sent = iter(handoff)
    assert torch.equal(next(sent), flat_buckets(named, metas).__next__())  # the bucket copied before the error
    with pytest.raises(RuntimeError, match="snapshot failed part-way"):
        next(sent)


def test_a_rank_without_the_group_secret_is_refused_by_every_other_rank():
    """The worker knows the group's prefix (anyone can list the store's keys) but not its secret:
    the learner refuses the group before a single weight is sent, and so does the worker."""
    from dataclasses import replace

    sender = build_sender(WeightSyncSection(backend="gloo", timeout_s=15))
    ticket = sender.rendezvous(1)
    thread, outcome = _worker(sender, replace(ticket, secret=b"guessed" * 5))
    with pytest.raises(PermissionError, match=r"rank\(s\) \[1\] do not hold the group secret"):
        sender.form_group(epoch=1, world_size=2)
    thread.join(15)
    assert isinstance(outcome["error"], PermissionError) and "rank(s) [0]" in str(outcome["error"])
    assert sender.group is None


# --- checkpoint layout and supported families -------------------------------------------------------

def _tiny(tmp_path, arch: str, tied: bool | None = None):
    from transformers import AutoModelForCausalLM

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    path = write_tiny_model(TinyModelSection(arch=arch, hidden_size=32, intermediate_size=32), tmp_path / arch,
                            tie_word_embeddings=tied)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_checkpoint_layout_turns_fused_moe_experts_into_the_checkpoints_names(tmp_path):
    from safetensors.torch import load_file

    from rlmesh.services.weights.layout import CheckpointLayout
    from rlmesh.services.weights.wire import describe

    path, model = _tiny(tmp_path, "mixtral")
    named = list(model.state_dict().items())  # transformers 5 in memory: experts.gate_up_proj, mlp.*
    layout = CheckpointLayout(model.config)
    layout.plan(describe(named))
    assert layout.reverts
    got = dict(layout.convert(iter(named)))
    on_disk = load_file(path / "model.safetensors")
    assert sorted(got) == sorted(on_disk)  # block_sparse_moe.experts.{e}.w1/w2/w3.weight
    assert all(torch.equal(got[k], on_disk[k]) for k in on_disk)


def test_checkpoint_layout_streams_plain_families_as_sent_and_drops_a_tied_head(tmp_path):
    from rlmesh.services.weights.layout import CheckpointLayout
    from rlmesh.services.weights.wire import describe

    _, model = _tiny(tmp_path, "gemma3")  # ties its output layer
    named = list(model.state_dict().items())
    layout = CheckpointLayout(model.config)
    layout.plan(describe(named))
    assert not layout.reverts
    assert [n for n, _ in layout.convert(iter(named))] == [n for n, _ in named if n != "lm_head.weight"]


def test_tiny_model_families_keep_qwen2_and_llama_as_before(tmp_path):
    """New families do not change what the original two write (other tests' baselines)."""
    from rlmesh.learner.devtools.tiny_model import ARCHS, TIED_BY_DEFAULT

    assert ARCHS[:2] == ("qwen2", "llama") and not {"qwen2", "llama"} & TIED_BY_DEFAULT
    _, model = _tiny(tmp_path, "qwen3")
    assert model.config.tie_word_embeddings and type(model).__name__ == "Qwen3ForCausalLM"


def test_unsupported_architecture_is_refused_naming_it_and_the_supported_families(tmp_path):
    import json

    from rlmesh.services.model_families import UnsupportedArchitecture, check_supported_architecture

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    assert check_supported_architecture(tmp_path) == "Gemma 3 (text-only)"
    for arch in ("MixtralForCausalLM", "Olmo2ForCausalLM", "SomethingNewForCausalLM"):
        with pytest.raises(UnsupportedArchitecture, match=f"{arch}.*supported families: .*LlamaForCausalLM"):
            check_supported_architecture({"architectures": [arch]})


def test_model_families_imports_without_torch_or_vllm():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = sys.modules['vllm'] = None; "
            "import rlmesh.services.model_families as m; print(m.check_supported_architecture("
            "{'architectures': ['Qwen3ForCausalLM']}))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "Qwen3"
