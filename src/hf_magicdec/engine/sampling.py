"""Verification: which draft tokens each row keeps.

Vocabulary (as in the vLLM rejection sampler): of the γ *draft* tokens a row *accepts* a prefix
of length ``n``; then one more token is emitted: the *recovered* token (sampled from the
residual distribution at the first rejection, or the target's argmax under greedy) or, when all
γ were accepted, the *bonus* token (from the target distribution after the last draft). A row
therefore emits ``n + 1`` tokens per verification step.

Sampling follows Leviathan et al. (2023) / Chen et al. (2023): accept draft token ``d`` with
probability ``min(1, target_probs(d) / draft_probs(d))``; on rejection sample from
``norm(max(target_probs - draft_probs, 0))``. The emitted tokens are distributed exactly as
sampling from the target alone.
"""

from __future__ import annotations

import torch


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for a batch of rows.

    Parameters
    ----------
    draft_tokens : ``[B, gamma]`` long, each sampled from the matching ``draft_probs`` row.
    draft_probs : ``[B, gamma, V]`` the (processed) draft distributions the tokens came from.
    target_probs : ``[B, gamma + 1, V]`` the (processed) target distributions.
    generator : optional RNG (default: torch's global RNG, so ``torch.manual_seed`` makes runs
        reproducible).

    Returns
    -------
    num_accepted : ``[B]`` long in ``[0, gamma]``.
    next_tokens : ``[B]`` long, the recovered token (first rejection) or the bonus token.
    """
    batch, gamma = draft_tokens.shape
    device = draft_tokens.device
    idx = draft_tokens[..., None]
    target_at_draft = target_probs[:, :gamma].gather(-1, idx).squeeze(-1)  # [B, gamma]
    draft_at_draft = draft_probs.gather(-1, idx).squeeze(-1)  # [B, gamma]
    uniform = torch.rand((batch, gamma), device=device, generator=generator, dtype=target_probs.dtype)
    # u < p/q  <=>  u*q < p (q > 0 because the token was sampled from q).
    accepted = uniform * draft_at_draft < target_at_draft
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

    # Residual at the first rejection; the bonus position uses q = 0, i.e. the target itself.
    gather_at = num_accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])
    target_next = target_probs.gather(1, gather_at).squeeze(1)  # [B, V]
    padded_draft = torch.cat([draft_probs, draft_probs.new_zeros((batch, 1, draft_probs.shape[-1]))], dim=1)
    draft_next = padded_draft.gather(1, gather_at).squeeze(1)  # [B, V]
    residual = torch.clamp(target_next - draft_next, min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass, but then rejection has probability 0 anyway;
    # fall back to the target so the draw is always well defined.
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target_next)
    next_tokens = torch.multinomial(residual, num_samples=1, generator=generator).squeeze(1)
    return num_accepted, next_tokens


def pick(scores: torch.Tensor, do_sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row from processed ``scores [b, V]``, as stock ``generate`` draws it.

    Returns ``(tokens [b], probs [b, V] or None)``: the distribution sampled from (None under greedy).
    """
    if not do_sample:
        return scores.argmax(dim=-1), None
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1).squeeze(1), probs


def accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_scores: torch.Tensor,
           do_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``drafts [b, γ]`` against processed ``target_scores [b, γ + 1, V]``.

    Returns ``(accepted [b], tokens [b, γ + 1])``: each row emits ``tokens[r, :accepted[r] + 1]``
    (its accepted drafts, then the recovered or bonus token; the rest is arbitrary). With γ = 0
    this is plain decoding: the same draw as stock ``generate``.
    """
    if drafts.shape[1] == 0:
        accepted = torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
        return accepted, pick(target_scores[:, 0], do_sample)[0][:, None]
    if do_sample:
        accepted, nxt = rejection_sample(drafts, draft_probs, torch.softmax(target_scores, dim=-1))
        tokens = torch.cat([drafts, nxt[:, None]], dim=1)
        return accepted, tokens.scatter_(1, accepted[:, None], nxt[:, None])
    # Greedy: the accepted drafts are the target's own argmax, so its argmax row is the emission.
    target_tokens = target_scores.argmax(dim=-1)  # [b, γ + 1]
    match = drafts == target_tokens[:, :-1]
    return match.long().cumprod(dim=1).sum(dim=1), target_tokens
