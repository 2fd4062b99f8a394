"""The registered ``magicdec`` attention: GQA folding equals a plain fp64 reference."""

from __future__ import annotations

import pytest
import torch

from hf_magicdec.engine.attention import gqa_attention


def _reference(query, key, value, mask, scaling):
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("group", [1, 3, 7, 8])
@pytest.mark.parametrize("q_len", [1, 5, 70])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_attention_matches_reference(group, q_len, head_dim):
    torch.manual_seed(group * 100 + q_len)
    batch, kv_heads, length = 3, 2, 83
    query = torch.randn(batch, kv_heads * group, q_len, head_dim)
    key = torch.randn(batch, kv_heads, length, head_dim)
    value = torch.randn(batch, kv_heads, length, head_dim)
    # Ragged rows: each row sees a different prefix, causal inside the query block.
    ends = torch.tensor([length - q_len, 40, 17])
    qpos = ends[:, None] + torch.arange(q_len)
    mask = (torch.arange(length)[None, None, :] <= qpos[:, :, None])[:, None]
    mask[2, :, :, :3] = False  # left padding
    got = gqa_attention(query, key, value, mask, head_dim**-0.5)
    want = _reference(query, key, value, mask, head_dim**-0.5)
    assert got.shape == (batch, q_len, kv_heads * group, head_dim)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_noncontiguous_query_layout_from_models():
    """Models hand over ``[B, q, H, D]`` transposed queries; the fold must not mix heads."""
    torch.manual_seed(0)
    query = torch.randn(2, 5, 6, 16).transpose(1, 2)  # [B, H, q, D], non-contiguous
    key, value = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    torch.testing.assert_close(
        gqa_attention(query, key, value, mask, 0.25).double(), _reference(query, key, value, mask, 0.25),
        rtol=1e-4, atol=1e-5,
    )
