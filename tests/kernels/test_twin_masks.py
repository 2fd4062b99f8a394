"""The PyTorch twin's masks: built once per forward and shared by its layers, in the form each
path consumes (SDPA: folded for GQA and additive; the mass path: folded and inverted), with the
same output, bit for bit, as the bool mask they are made from."""

from __future__ import annotations

import torch

from hf_magicdec.kernels import Segments, reference


def _inputs(batch, heads, kv_heads, q_len, kv_len, dtype=torch.float32):
    gen = torch.Generator().manual_seed(batch * 100 + q_len)
    query = torch.randn(batch, heads, q_len, 32, generator=gen).to(dtype)
    key = torch.randn(batch, kv_heads, kv_len, 32, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads, kv_len, 32, generator=gen).to(dtype)
    pad = torch.tensor([0, 3, 9][:batch], dtype=torch.int32)
    lengths = torch.tensor([kv_len, kv_len - 5, kv_len - 11][:batch], dtype=torch.int32)
    return query, key, value, Segments.causal(pad, lengths)


def test_every_layer_of_a_forward_shares_one_sdpa_mask_and_gets_the_bool_masks_output():
    for heads, kv_heads, q_len, dtype in ((6, 2, 4, torch.float32), (4, 4, 4, torch.float32),
                                          (6, 2, 1, torch.bfloat16), (4, 1, 70, torch.float32)):
        query, key, value, segments = _inputs(3, heads, kv_heads, q_len, 90, dtype)
        first = reference.segment_attention(query, key, value, segments, 0.2)
        assert len(segments._derived) == 1
        built = next(iter(segments._derived.values()))
        again = reference.segment_attention(query * 0.5, key, value, segments, 0.2)  # the next layer
        assert len(segments._derived) == 1 and next(iter(segments._derived.values())) is built
        assert built.dtype == dtype  # additive, in the query's dtype: SDPA converts nothing per call
        for q, out in ((query, first), (query * 0.5, again)):
            assert torch.equal(out, reference.gqa_attention(q, key, value, segments.mask(q_len, 90), 0.2))


def test_the_mass_path_shares_its_mask_and_normalises_after_the_products():
    query, key, value, segments = _inputs(3, 6, 2, 4, 90)
    out, mass = reference.segment_attention(query, key, value, segments, 0.2, page_size=16)
    reference.segment_attention(query, key, value, segments, 0.2, page_size=16)
    assert len(segments._derived) == 1
    # The probabilities normalised first, as a reader would write them.
    folded = query.reshape(3, 2, 12, 32)
    logits = (folded @ key.transpose(-1, -2)) * 0.2
    mask = segments.mask(4, 90)[:, :, None].expand(-1, -1, 3, -1, -1).reshape(3, 1, 12, 90)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    want_out = (probs @ value).reshape(3, 6, 4, 32).transpose(1, 2)
    want_mass = torch.nn.functional.pad(probs.sum(2), (0, 6)).reshape(3, 2, 6, 16).sum(-1)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=1e-6)
