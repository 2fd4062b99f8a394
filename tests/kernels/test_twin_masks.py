"""The PyTorch twin's masks: built once per forward and shared by its layers, in the form each
path consumes (SDPA: folded for GQA and additive; the mass path: folded and inverted, and as the
additive bias its product starts from), with the same output as the bool mask they are made from."""

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


def test_the_mass_path_shares_its_masks_and_matches_the_softmax_a_reader_would_write():
    query, key, value, segments = _inputs(3, 6, 2, 4, 90)
    out, mass = reference.segment_attention(query, key, value, segments, 0.2, page_size=16)
    built = dict(segments._derived)
    assert len(built) == 2  # the folded inverted mask (with which rows see a key) and the additive bias
    reference.segment_attention(query * 0.5, key, value, segments, 0.2, page_size=16)  # the next layer
    assert segments._derived.keys() == built.keys() and all(segments._derived[k] is v for k, v in built.items())
    reference.segment_attention(query, key, value, segments, 0.2, softcap=30.0, page_size=16)  # capped: the mask
    assert segments._derived.keys() == built.keys()
    # The probabilities normalised first, as a reader would write them.
    folded = query.reshape(3, 2, 12, 32)
    logits = (folded @ key.transpose(-1, -2)) * 0.2
    mask = segments.mask(4, 90)[:, :, None].expand(-1, -1, 3, -1, -1).reshape(3, 1, 12, 90)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    want_out = (probs @ value).reshape(3, 6, 4, 32).transpose(1, 2)
    want_mass = torch.nn.functional.pad(probs.sum(2), (0, 6)).reshape(3, 2, 6, 16).sum(-1)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=1e-6)


def test_the_mass_path_gives_a_query_that_sees_no_key_zeros():
    """A row whose ranges are empty (no key for any query) gets a zero output and zero mass, not
    NaN, with or without soft-capping and sinks; the other rows are unaffected."""
    query, key, value, _ = _inputs(3, 6, 2, 4, 90)
    zero = torch.zeros(3, dtype=torch.int32)
    segments = Segments(zero, zero, torch.tensor([0, 5, 40], dtype=torch.int32), torch.tensor([90, 5, 80], dtype=torch.int32))
    for softcap, sinks in ((None, None), (30.0, None), (None, torch.randn(6)), (30.0, torch.randn(6))):
        out, mass = reference.segment_attention(query, key, value, segments, 0.2, softcap, sinks, page_size=16)
        assert torch.isfinite(out).all() and torch.isfinite(mass).all()
        assert (out[1] == 0).all() and (mass[1] == 0).all()
        alone, alone_mass = reference.segment_attention(query[[0, 2]], key[[0, 2]], value[[0, 2]], Segments(
            zero[:2], zero[:2], torch.tensor([0, 40], dtype=torch.int32), torch.tensor([90, 80], dtype=torch.int32)),
            0.2, softcap, sinks, page_size=16)
        torch.testing.assert_close(out[[0, 2]], alone)
        torch.testing.assert_close(mass[[0, 2]], alone_mass)
        if sinks is None:  # every query that sees keys gives them all its mass
            torch.testing.assert_close(mass[[0, 2]].sum(-1), torch.full((2, 2), 12.0))
