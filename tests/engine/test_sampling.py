"""Lossless sampling: the rejection sampler alone, and end to end against stock sampling."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from hf_magicdec.engine.sampling import accept, rejection_sample

from conftest import make_model


# ---------------------------------------------------------------- greedy verification tables
@pytest.mark.parametrize(
    "drafts,target_argmax,accepted,next_token",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, 8),  # all accepted: bonus token
        ([5, 6, 7], [5, 9, 7, 8], 1, 9),  # mismatch at position 1: recovered token
        ([5, 6, 7], [4, 6, 7, 8], 0, 4),  # mismatch at once
        ([5, 6, 7], [5, 6, 3, 8], 2, 3),
    ],
)
def test_greedy_verify_table(drafts, target_argmax, accepted, next_token):
    vocab = 10
    scores = torch.full((1, len(target_argmax), vocab), -1.0)
    for i, t in enumerate(target_argmax):
        scores[0, i, t] = 1.0
    n, tokens = accept(torch.tensor([drafts]), None, scores, do_sample=False)
    assert n.tolist() == [accepted] and tokens[0, :accepted].tolist() == drafts[:accepted]
    assert tokens[0, accepted].item() == next_token


def test_greedy_verify_ragged_rows():
    scores = torch.zeros(3, 3, 4)
    scores[:, :, 1] = 1.0  # target always says 1
    drafts = torch.tensor([[1, 1], [1, 2], [0, 1]])
    n, tokens = accept(drafts, None, scores, do_sample=False)
    assert n.tolist() == [2, 1, 0] and tokens.gather(1, n[:, None]).squeeze(1).tolist() == [1, 1, 1]


# ---------------------------------------------------------------- rejection sampler
def test_identical_distributions_accept_everything():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(64, 4, 11), dim=-1)
    drafts = torch.multinomial(probs[:, :3].reshape(-1, 11), 1).reshape(64, 3)
    n, _ = rejection_sample(drafts, probs[:, :3], probs)
    assert n.tolist() == [3] * 64


def test_impossible_draft_is_rejected_and_recovered_from_target():
    target = torch.zeros(8, 2, 5)
    target[:, :, 3] = 1.0  # the target only ever emits 3
    draft = torch.zeros(8, 1, 5)
    draft[:, :, 1] = 1.0
    n, nxt = rejection_sample(torch.ones(8, 1, dtype=torch.long), draft, target)
    assert n.tolist() == [0] * 8 and nxt.tolist() == [3] * 8


def test_seeded_determinism():
    probs_t = torch.softmax(torch.randn(16, 5, 7, generator=torch.Generator().manual_seed(1)), -1)
    probs_d = torch.softmax(torch.randn(16, 4, 7, generator=torch.Generator().manual_seed(2)), -1)
    drafts = torch.multinomial(probs_d.reshape(-1, 7), 1, generator=torch.Generator().manual_seed(3)).reshape(16, 4)
    a = rejection_sample(drafts, probs_d, probs_t, generator=torch.Generator().manual_seed(7))
    b = rejection_sample(drafts, probs_d, probs_t, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("gamma", [1, 3])
def test_emitted_tokens_follow_the_target(gamma):
    """Every emitted position is distributed as the target, whatever the draft (chi-square)."""
    vocab, rows = 6, 60_000
    g = torch.Generator().manual_seed(gamma)
    target = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    draft = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    target_probs = target.expand(rows, gamma + 1, vocab)
    draft_probs = draft.expand(rows, gamma, vocab)
    drafts = torch.multinomial(draft, rows * gamma, replacement=True, generator=g).reshape(rows, gamma)
    n, nxt = rejection_sample(drafts, draft_probs, target_probs, generator=g)
    # The first emitted token: drafts[:, 0] if accepted, else the recovered one.
    first = torch.where(n > 0, drafts[:, 0], nxt)
    observed = torch.bincount(first, minlength=vocab).double()
    expected = target.double() / target.double().sum() * rows
    p = stats.chisquare(observed.numpy(), expected.numpy()).pvalue
    assert p > 1e-3, p
    # Acceptance probability matches theory: sum_x min(p(x), q(x)).
    alpha = torch.minimum(target, draft).sum().item()
    measured = (n > 0).double().mean().item()
    assert abs(measured - alpha) < 0.01


# ---------------------------------------------------------------- end to end
def _first_tokens_distribution(model, prompt, steps):
    """Exact distribution of generated tokens 1..steps by enumeration (no processors)."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        prefix_probs = torch.ones(1)
        prefixes = prompt[None, :]
        marginals = []
        for _ in range(steps):
            logits = model(prefixes).logits[:, -1].double()
            cond = torch.softmax(logits, -1)  # [n_prefix, V]
            joint = prefix_probs[:, None] * cond
            marginals.append(joint.sum(0))
            prefixes = torch.cat(
                [prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], 1
            )
            prefix_probs = joint.reshape(-1)
        return marginals


def test_sampled_output_matches_exact_target_distribution():
    """Batched speculative sampling (many rows in one call, ragged acceptance) reproduces the
    model's exact marginal distributions of generated tokens 1..3 (chi-square goodness of fit)."""
    model = make_model("llama-gqa3", seed=4, vocab_size=12)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.2)  # soften: a spread distribution exercises every branch
    prompt = torch.randint(3, 12, (24,), generator=torch.Generator().manual_seed(0))
    rows = 4000
    exact = _first_tokens_distribution(model, prompt, 3)
    torch.manual_seed(123)
    out = model.generate(
        input_ids=prompt.expand(rows, -1).clone(),
        max_new_tokens=3,
        do_sample=True,
        top_k=0,
        temperature=1.0,
        eos_token_id=None,
        speculative="magicdec",
        draft_budget=8,
        sink_tokens=2,
        gamma=2,
        return_dict_in_generate=True,
    )
    assert out.speculation.acceptance_rate < 0.95  # the draft really differs from the target
    new = out.sequences[:, 24:]
    for k in range(3):
        observed = torch.bincount(new[:, k], minlength=12).double().numpy()
        expected = (exact[k] / exact[k].sum() * rows).numpy()
        p = stats.chisquare(observed, expected).pvalue
        assert p > 1e-3, (k, p, observed, expected)


def test_sampling_with_warpers_matches_stock_sampling():
    """Two-sample chi-square against stock ``generate`` with temperature, top-k, top-p,
    repetition penalty: same distribution of the 3rd and 4th generated tokens."""
    model = make_model("qwen2-gqa7", seed=5, vocab_size=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.randint(3, 16, (20,), generator=torch.Generator().manual_seed(1))
    rows = 3000
    kwargs = dict(
        input_ids=prompt.expand(rows, -1).clone(), max_new_tokens=4, do_sample=True, temperature=0.8, top_k=10,
        top_p=0.95, repetition_penalty=1.2, eos_token_id=None,
    )
    torch.manual_seed(0)
    stock = model.generate(**kwargs)[:, 20:]
    torch.manual_seed(1)
    spec = model.generate(**kwargs, speculative="magicdec", draft_budget=8, sink_tokens=2, gamma=3)[:, 20:]
    for k in (2, 3):
        a = torch.bincount(stock[:, k], minlength=16)
        b = torch.bincount(spec[:, k], minlength=16)
        keep = (a + b) > 0
        table = torch.stack([a[keep], b[keep]]).numpy()
        p = stats.chi2_contingency(table).pvalue
        assert p > 1e-3, (k, p, table)


def test_seeded_sampling_is_reproducible():
    model = make_model("llama-gqa3", seed=6)
    ids = torch.randint(3, 128, (4, 30), generator=torch.Generator().manual_seed(2))
    kwargs = dict(input_ids=ids, max_new_tokens=20, do_sample=True, top_p=0.9, speculative="magicdec",
                  draft_budget=12, sink_tokens=2, gamma=3, eos_token_id=None)
    torch.manual_seed(42)
    a = model.generate(**kwargs)
    torch.manual_seed(42)
    b = model.generate(**kwargs)
    assert torch.equal(a, b)


def test_gamma_zero_sampling_draws_exactly_like_stock():
    """With drafting off, the engine consumes the RNG exactly as stock sampling: same seed, same tokens."""
    model = make_model("qwen2-gqa7", seed=3)
    ids = torch.randint(3, 128, (3, 25), generator=torch.Generator().manual_seed(4))
    kwargs = dict(input_ids=ids, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=40, eos_token_id=None)
    torch.manual_seed(7)
    stock = model.generate(**kwargs)
    torch.manual_seed(7)
    ours = model.generate(**kwargs, speculative="magicdec", gamma=0)
    assert torch.equal(stock, ours)
