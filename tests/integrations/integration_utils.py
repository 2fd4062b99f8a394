"""Helpers shared by the integration tests (TRL, training mode, PEFT): a word-level tokenizer for the
tiny random models of ``tests/conftest.py``, a snapshot of everything generation must leave as it
found, exact target distributions for chi-square checks, and counters of what ran.

Imported as ``from integration_utils import ...`` (pytest puts this folder on ``sys.path``: the
test folders have no ``__init__.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

PAD, BOS, EOS = 0, 1, 2  # as tests/conftest.py


def word_tokenizer(vocab_size: int):
    """A fast tokenizer over ``<pad> <s> </s> t3 .. t{V-1}`` (whitespace-separated words), the ids of
    ``make_model``'s vocabulary; left padding, as generation wants."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"t{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.padding_side = "left"
    return tok


def text_prompts(lengths, vocab_size: int, seed: int = 0) -> list[str]:
    """Prompts of the given lengths in tokens (no special tokens), as text for ``word_tokenizer``."""
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"t{int(t)}" for t in torch.randint(3, vocab_size, (n,), generator=g)) for n in lengths]


def checkpointing(model) -> bool:
    """Whether gradient (activation) checkpointing is on, without transformers' deprecation warning."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(flag if flag is not None else model.is_gradient_checkpointing)


@dataclass
class ModelState:
    """What generation must leave exactly as it found it."""

    training: dict[str, bool]
    checkpointing: bool
    layer_checkpointing: dict[str, Any]
    attn_implementation: Any
    use_cache: Any
    generation_config: dict[str, Any]
    requires_grad: dict[str, bool]
    params: dict[str, torch.Tensor] = field(repr=False)
    grads: dict[str, torch.Tensor | None] = field(repr=False)

    @classmethod
    def of(cls, model) -> ModelState:
        named = list(model.named_parameters())
        return cls(
            training={n: m.training for n, m in model.named_modules()},
            checkpointing=checkpointing(model),
            layer_checkpointing={n: m.gradient_checkpointing for n, m in model.named_modules()
                                 if hasattr(m, "gradient_checkpointing")},
            attn_implementation=model.config._attn_implementation,
            use_cache=getattr(model.config, "use_cache", None),
            generation_config=model.generation_config.to_dict(),
            requires_grad={n: p.requires_grad for n, p in named},
            params={n: p.detach().clone() for n, p in named},
            grads={n: None if p.grad is None else p.grad.detach().clone() for n, p in named},
        )

    def assert_same(self, other: ModelState, what: str = "") -> None:
        for name in ("training", "checkpointing", "layer_checkpointing", "attn_implementation", "use_cache",
                     "generation_config", "requires_grad"):
            assert getattr(self, name) == getattr(other, name), f"{what}: {name} changed"
        assert self.params.keys() == other.params.keys(), f"{what}: parameters added or removed"
        changed = [n for n in self.params if not torch.equal(self.params[n], other.params[n])]
        assert not changed, f"{what}: parameters changed: {changed[:5]}"
        grads = [n for n in self.grads if (self.grads[n] is None) != (other.grads[n] is None)
                 or (self.grads[n] is not None and not torch.equal(self.grads[n], other.grads[n]))]
        assert not grads, f"{what}: gradients changed: {grads[:5]}"


@dataclass
class Runs:
    """How often the MagicDec engine ran (``engine``) during a block."""

    engine: int = 0


@contextlib.contextmanager
def counting_engine_runs() -> Iterator[Runs]:
    """Count calls of the MagicDec engine's decoding loop (``hf_magicdec.engine.loop.Engine.run``),
    the only code that speculates: a call that the planner (or anything else) sends to stock
    decoding never reaches it. If the library moves its loop, update this one place."""
    from hf_magicdec.engine import loop

    runs = Runs()
    original = loop.Engine.run

    @functools.wraps(original)
    def run(self, *args, **kwargs):
        runs.engine += 1
        return original(self, *args, **kwargs)

    loop.Engine.run = run
    try:
        yield runs
    finally:
        loop.Engine.run = original


@contextlib.contextmanager
def counting_forwards(model) -> Iterator[list[int]]:
    """``[n]``: forwards of ``model`` (its outermost module) during the block."""
    count = [0]
    handle = model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


@torch.no_grad()
def exact_marginals(model, prompt: torch.Tensor, steps: int, *, eos: int | None = EOS, pad: int = PAD,
                    temperature: float = 1.0) -> list[torch.Tensor]:
    """The exact distributions ``[V]`` of generated tokens ``0 .. steps-1`` after ``prompt [P]`` under
    plain sampling at ``temperature`` (no other warper), enumerating every prefix. With ``eos``,
    a row that has emitted it continues with ``pad`` (as ``generate`` pads finished rows)."""
    was_training = model.training
    model.eval()
    try:
        vocab = model.config.vocab_size
        prefix_probs = torch.ones(1, dtype=torch.float64)
        prefixes = prompt[None, :]
        marginals = []
        for _ in range(steps):
            logits = model(prefixes).logits[:, -1].double() / temperature
            cond = torch.softmax(logits, -1)
            if eos is not None:
                done = (prefixes[:, prompt.shape[0]:] == eos).any(1)
                cond[done] = 0.0
                cond[done, pad] = 1.0
            joint = prefix_probs[:, None] * cond
            marginals.append(joint.sum(0))
            prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                                  torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], 1)
            prefix_probs = joint.reshape(-1)
        return marginals
    finally:
        model.train(was_training)


def goodness_of_fit(observed_tokens: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square p-value of the tokens ``[N]`` against ``expected_probs [V]``, cells with an expected
    count under ``min_expected`` pooled into one."""
    from scipy import stats

    n = observed_tokens.numel()
    observed = torch.bincount(observed_tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs / expected_probs.sum() * n
    small = expected < min_expected
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was generated"
    obs = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    return float(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)
