"""The actor's local-spec core attention (torch SDPA) against megatron's DotProductAttention.

One-rank gloo group, float64 inputs so that the two implementations agree to ~1e-12;
about 3 s.
"""

from __future__ import annotations

import collections

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.models.factory import build_transformer_config
from pipeline.models.layer_spec import LayerSpecChoice, local_layer_spec
from pipeline.models.local_modules import SDPADotProductAttention
from pipeline.models.spec import ModelSpec
from tests.distributed_utils import one_rank_context

SEQ, BATCH, HEAD_DIM = 10, 3, 8


@pytest.fixture(scope="module")
def context():
    with one_rank_context() as ctx:
        yield ctx


def _config(*, heads: int, groups: int, **overrides):
    spec = ModelSpec(family="llama", vocab_size=32, hidden_size=heads * HEAD_DIM, ffn_hidden_size=16, num_layers=1,
                     num_attention_heads=heads, num_query_groups=groups, max_position_embeddings=64)
    # The CPU's config on any machine: the float64 inputs below are CPU tensors, and a GPU config's
    # fused softmax would take megatron's CUDA kernel path.
    return build_transformer_config(spec, choice=LayerSpecChoice(name="local", reason="test"), overrides=overrides,
                                    device=torch.device("cpu"))


def _pair(config, mask_type=AttnMaskType.causal):
    return tuple(
        cls(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")
        for cls in (DotProductAttention, SDPADotProductAttention)
    )


def _qkv(heads: int, groups: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(SEQ, BATCH, heads, HEAD_DIM), (SEQ, BATCH, groups, HEAD_DIM), (SEQ, BATCH, groups, HEAD_DIM)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]  # [s, b, n, d]


def _run(module, qkv, mask, **kwargs):
    leaves = [x.clone().requires_grad_() for x in qkv]
    out = module(*leaves, mask, **kwargs)  # (s, b, n·d)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _assert_same(got, expected):
    torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-12)
    for actual, reference in zip(got[1], expected[1]):
        torch.testing.assert_close(actual, reference, rtol=1e-12, atol=1e-12)


def _causal_mask():
    return torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_causal_matches_dot_product_attention(context, heads, groups):
    megatron, sdpa = _pair(_config(heads=heads, groups=groups))
    qkv = _qkv(heads, groups)
    expected = _run(megatron, qkv, _causal_mask())
    assert expected[0].shape == (SEQ, BATCH, heads * HEAD_DIM)
    _assert_same(_run(sdpa, qkv, _causal_mask()), expected)


def test_causal_ignores_the_mask_argument_like_transformer_engine(context):
    megatron, sdpa = _pair(_config(heads=4, groups=2))
    qkv = _qkv(4, 2, seed=1)
    nothing_masked = torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool)
    _assert_same(_run(sdpa, qkv, nothing_masked), _run(megatron, qkv, _causal_mask()))
    _assert_same(_run(sdpa, qkv, None), _run(megatron, qkv, _causal_mask()))


def test_padding_mask_is_applied(context):
    megatron, sdpa = _pair(_config(heads=4, groups=2), mask_type=AttnMaskType.padding)
    qkv = _qkv(4, 2, seed=2)
    lengths = torch.tensor([SEQ, 6, 3])
    mask = (torch.arange(SEQ) >= lengths[:, None])[:, None, None, :]  # (b, 1, 1, s): padded keys
    expected = _run(megatron, qkv, mask)
    _assert_same(_run(sdpa, qkv, mask), expected)
    # The mask matters: without it the rows attending to padded keys change.
    unmasked = _run(sdpa, qkv, torch.zeros_like(mask))
    assert not torch.allclose(unmasked[0], expected[0])


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_sdpa_kernel_is_used_and_unsupported_features_fall_back(context):
    qkv = _qkv(4, 2)
    _, sdpa = _pair(_config(heads=4, groups=2))
    with _OpNames() as ops:
        sdpa(*qkv, _causal_mask())
    assert not ops.names["baddbmm"] and any("scaled_dot_product" in name for name in ops.names)

    # Per-layer QK scaling keeps megatron's own softmax path, bit for bit.
    megatron, scaled = _pair(_config(heads=4, groups=2, apply_query_key_layer_scaling=True))
    with _OpNames() as ops:
        got = scaled(*qkv, _causal_mask())
    assert ops.names["baddbmm"] == 1
    assert torch.equal(got, megatron(*qkv, _causal_mask()))


def test_dropout_in_training_and_a_longer_key_cache_fall_back(context):
    _, sdpa = _pair(_config(heads=4, groups=2, attention_dropout=0.1))
    square = {"causal": True, "query_length": SEQ, "key_length": SEQ}
    assert not sdpa.train()._sdpa_supported(**square)
    assert sdpa.eval()._sdpa_supported(**square)  # no dropout at evaluation
    assert not sdpa._sdpa_supported(causal=True, query_length=1, key_length=SEQ)
    assert sdpa._sdpa_supported(causal=False, query_length=1, key_length=SEQ)


def test_local_layer_spec_uses_sdpa_attention():
    spec = local_layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is SDPADotProductAttention
