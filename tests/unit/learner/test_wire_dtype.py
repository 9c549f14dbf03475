"""The weight broadcast carries the dtype the rollout tier serves: with `rollout.dtype=bfloat16` the
layout and the stream are bfloat16 (half of fp32's bytes), the values the learner's cast down."""

from __future__ import annotations

import torch

from tests.unit.learner.test_baseline import make_trainer


def test_a_bf16_rollout_tier_gets_bf16_bytes(tiny_model_dir):
    fp32 = make_trainer(tiny_model_dir, 12)
    sent32 = dict(fp32.stream_weights())
    bf16 = make_trainer(tiny_model_dir, 12, "rollout.dtype=bfloat16")
    metas = bf16.weight_metas()
    sent = dict(bf16.stream_weights())
    assert {m.dtype for m in metas} == {"bfloat16"} and {t.dtype for t in sent.values()} == {torch.bfloat16}
    assert [m.name for m in metas] == list(sent) == list(sent32)
    assert sum(m.nbytes for m in metas) * 2 == sum(m.nbytes for m in fp32.weight_metas())
    assert all(torch.equal(sent[name], tensor.to(torch.bfloat16)) for name, tensor in sent32.items())
    assert {m.dtype for m in fp32.weight_metas()} == {"float32"}
