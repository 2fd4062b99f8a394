"""Shared fixtures: offline environment and tiny random-weight models of several architectures."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on CPU through Triton's interpreter; it must be chosen before Triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import hf_magicdec  # noqa: F401  (installs the routing)
from hf_magicdec.views import DraftView, ScoreContext
from triton_bridges import bridge_triton_interpreter  # tests/, on sys.path beside this conftest

# torch 2.11 / Triton 3.6 under the interpreter; before any kernel module is imported (the library
# imports hf_magicdec.kernels.triton_kernels at the first kernel call).
bridge_triton_interpreter()

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@dataclass(frozen=True)
class RecentOnly(DraftView):
    """A user-defined draft view, registered here before collection so that every test
    parametrised over ``available_views()`` runs it end to end: the static part holds the
    ``static_tokens`` latest prompt tokens before the rolling window (no sinks); its option
    ``static_tokens`` is no built-in view's, so routing it exercises the generic option path."""

    name: ClassVar[str] = "recent-only"

    static_tokens: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.static_tokens, int) or self.static_tokens < 0:
            raise ValueError(f"static_tokens must be an int >= 0, got {self.static_tokens!r}.")

    def check(self, budget: int, gamma: int) -> None:
        super().check(budget, gamma)
        if self.static_tokens >= budget:
            raise ValueError(f"recent-only needs draft_budget > static_tokens, got {budget} and {self.static_tokens}.")

    def static_slots(self, budget: int, prompt_len: int) -> int:
        return self.static_tokens

    def window_slots(self, budget: int, gamma: int, prompt_len: int, max_new_tokens: int) -> int:
        return budget - self.static_tokens

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        batch, kv_heads, slots, _ = ctx.keys.shape
        return torch.arange(slots, device=ctx.keys.device, dtype=torch.float32).expand(batch, kv_heads, slots)


hf_magicdec.register_view(RecentOnly)

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2

# name -> (class, config kwargs): GQA ratios 3 (Llama), 7 (Qwen2) and 1 (Mistral, i.e. MHA).
ARCHS = {
    "llama-gqa3": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2),
    ),
    "qwen2-gqa7": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(hidden_size=112, intermediate_size=160, num_attention_heads=7, num_key_value_heads=1),
    ),
    "mistral-mha": (
        MistralForCausalLM,
        MistralConfig,
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, sliding_window=None),
    ),
}


def make_model(arch: str, seed: int = 0, layers: int = 2, **overrides):
    model_cls, config_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        max_position_embeddings=1024,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        **kwargs,
    )
    config = config_cls(**{**settings, **overrides})
    model = model_cls(config).eval()
    # Random weights give near-uniform logits; sharpen them so argmax is well separated and
    # the draft has something to agree with (acceptance far from 0).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.do_sample = False
    return model


@pytest.fixture(scope="session")
def tiny_models():
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = make_model(arch)
        return cache[arch]

    return get


def ragged_prompts(batch: int, length: int, seed: int = 0, min_len: int | None = None):
    """Left-padded prompts of different lengths: ``(input_ids [B, length], attention_mask)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    min_len = min_len if min_len is not None else max(1, length // 3)
    for b in range(1, batch):
        real = int(torch.randint(min_len, length + 1, (1,), generator=g))
        mask[b, : length - real] = 0
    ids[mask == 0] = PAD
    return ids, mask


def assert_view_samples_like_stock(new_tokens: int, **magicdec) -> None:
    """Sampling through a draft view reproduces stock sampling's distribution: 2,000 rows of one
    prompt on a 16-token vocabulary, a two-sample chi-square test per generated position after the
    first (``magicdec``: the view's generate keywords)."""
    from scipy import stats

    model = make_model("qwen2-gqa7", seed=5, vocab_size=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.randint(3, 16, (24,), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=prompt.expand(2000, -1).clone(), max_new_tokens=new_tokens, do_sample=True,
                  temperature=0.9, top_k=10, eos_token_id=None)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)[:, 24:]
    torch.manual_seed(1)
    spec = model.generate(**kwargs, speculative="magicdec", **magicdec)[:, 24:]
    for k in range(1, new_tokens):
        a, b = torch.bincount(stock[:, k], minlength=16), torch.bincount(spec[:, k], minlength=16)
        keep = (a + b) > 0
        assert stats.chi2_contingency(torch.stack([a[keep], b[keep]]).numpy()).pvalue > 1e-3, k


def slot_encoded_cache(keys: torch.Tensor, pad: list[int], capacity: int):
    """A one-layer MagicDecCache prefilled with ``keys [B, Hkv, P, D]`` whose values encode the slot
    (``value[..., 0] = slot``), so a draft view's contents can be read back as slots."""
    from hf_magicdec.engine.cache import MagicDecCache

    batch, _, prompt, _ = keys.shape
    cache = MagicDecCache(1, batch, capacity, torch.tensor(pad))
    cache.begin_prefill(0, prompt)
    values = torch.zeros_like(keys)
    values[..., 0] = torch.arange(prompt, dtype=keys.dtype)
    cache.update(keys, values, 0)
    cache.end_prefill(prompt)
    return cache


def static_slots(cache) -> torch.Tensor:
    """Full-cache slots held by layer 0's static part: ``[B, Hkv, Ks]`` (a :func:`slot_encoded_cache`)."""
    return cache.layers[0].draft_values[:, :, : cache.static_slots, 0].round().long()
