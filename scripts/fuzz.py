"""Differential fuzzing: ``generate(..., speculative="magicdec")`` against stock ``generate``.

    python scripts/fuzz.py --cases 600 --seed 1            # the long profile (docs/robustness.md)
    python scripts/fuzz.py --seed 1 --case 17              # re-run one case of that profile
    python scripts/fuzz.py --repro '{"family": ...}'       # re-run a case from its printed dict

Every case is drawn from its own ``random.Random(f"{seed}:{index}")``, so case ``i`` of seed ``s``
is the same case whatever else runs. A case is a random tiny model (architecture family, GQA
ratio, layers, attention sharpness, sliding window where the family has one), a random batch
(1-9 rows, left padding or none, prompt lengths), a random MagicDec configuration (draft view,
budget below or above the prompt, γ fixed, 0 or adaptive, view parameters, refresh, prefill
chunking, or everything ``"auto"``) and random decoding settings (logits processors, warpers,
EOS lists, stop strings, a user stopping criterion, ``num_return_sequences``, ``max_length``).

What is compared, by case kind:

``greedy``
    ``sequences`` token-identical to stock ``generate``.
``sample``
    Seeded sampling. Where MagicDec drafts nothing (γ = 0, or the planner chose plain decoding)
    it draws exactly like stock while every row is running: token-identical for the same seed up
    to the first step at which a row may finish (a finished row leaves the working batch, so later
    draws differ from stock's: same distribution), well-formed after. With drafting, a seeded
    equality is not defined (rejection sampling consumes the RNG differently), so the output must
    be well-formed: shape, prompts kept, tokens in the vocabulary, nothing but padding after EOS,
    no EOS before ``min_new_tokens``, no banned/suppressed token, no repeated n-gram under
    ``no_repeat_ngram_size``. With ``top_k=1`` sampling is deterministic and must equal stock.
``dist``
    Equal in distribution: a 16-token vocabulary, one prompt repeated over 1000 rows, 3 new
    tokens; for each generated position a two-sample chi-square test of stock's tokens against
    MagicDec's (fails below p = 1e-4).

Exit status 1 when any case failed; each failure prints its reproduction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from collections import OrderedDict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers as T  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList  # noqa: E402

import hf_magicdec  # noqa: E402,F401  (installs the routing)
from hf_magicdec import MagicDecConfig  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from triton_bridges import bridge_triton_interpreter  # noqa: E402

bridge_triton_interpreter()  # torch 2.11 / Triton 3.6 under the interpreter; before any kernel is imported

VOCAB = 128
DIST_VOCAB = 16
PAD, BOS, EOS = 0, 1, 2
HEAD_DIM = 16
DIST_ROWS = 1000
DIST_P = 1e-4

# family -> (model class, config class, extra config kwargs, sliding window: None | "optional" | "required")
FAMILIES = {
    "llama": (T.LlamaForCausalLM, T.LlamaConfig, dict(head_dim=HEAD_DIM), None),
    "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(), None),
    "mistral": (T.MistralForCausalLM, T.MistralConfig, dict(head_dim=HEAD_DIM), "optional"),
    "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(head_dim=HEAD_DIM), None),
    "phi3": (T.Phi3ForCausalLM, T.Phi3Config, dict(), None),
    "granite": (T.GraniteForCausalLM, T.GraniteConfig,
                dict(attention_multiplier=0.2, logits_scaling=0.5, embedding_multiplier=2.0, residual_multiplier=0.7),
                None),
    "gemma": (T.GemmaForCausalLM, T.GemmaConfig, dict(head_dim=HEAD_DIM, tie_word_embeddings=False), None),
    # Gemma 2: eager attention by default, attention-logit soft-capping, alternating sliding layers.
    "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config,
               dict(head_dim=HEAD_DIM, tie_word_embeddings=False, attn_logit_softcapping=20.0,
                    final_logit_softcapping=None, query_pre_attn_scalar=HEAD_DIM), "required"),
    "gemma3": (T.Gemma3ForCausalLM, T.Gemma3TextConfig, dict(head_dim=HEAD_DIM, tie_word_embeddings=False),
               "required"),
}
# (attention heads, KV heads): GQA ratios 1, 2, 3, 4, 7.
HEADS = [(4, 4), (4, 2), (6, 2), (4, 1), (7, 1), (6, 3), (8, 2)]
DRAFTS = ["streamingllm", "snapkv", "dynamic", "attended", "full", "auto"]

_MODELS: OrderedDict = OrderedDict()


def build_model(family: str, heads: int, kv_heads: int, layers: int, seed: int, sharpness: float,
                sliding_window: int | None = None, vocab: int = VOCAB, lm_scale: float = 8.0):
    """A tiny random-weight model (cached: the last 6 built)."""
    key = (family, heads, kv_heads, layers, seed, sharpness, sliding_window, vocab, lm_scale)
    if key in _MODELS:
        _MODELS.move_to_end(key)
        return _MODELS[key]
    model_cls, config_cls, extra, _ = FAMILIES[family]
    settings = dict(vocab_size=vocab, hidden_size=heads * HEAD_DIM, intermediate_size=96, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                    pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, **extra)
    if family == "mistral" or sliding_window is not None:
        settings["sliding_window"] = sliding_window
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_scale)  # well-separated argmax (conftest does the same)
        for name, p in model.named_parameters():  # sharper attention: a wrong key set shows
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(sharpness)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.do_sample = False
    _MODELS[key] = model
    while len(_MODELS) > 6:
        _MODELS.popitem(last=False)
    return model


_TOKENIZER = None


def char_tokenizer():
    """One character per token (ids 3.. -> 'a'..), as tests/test_api.py: enables ``stop_strings``."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        chars = [chr(c) for c in range(ord("a"), ord("a") + VOCAB - 3)]
        vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        tok.decoder = decoders.Fuse()
        _TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                             eos_token="</s>")
    return _TOKENIZER


class LengthBias(LogitsProcessor):
    """A user logits processor that depends on the sequence length and the last token: it only
    gives stock's result if it is called with exactly the right prefix at every position."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        rows = torch.arange(scores.shape[0])
        scores[rows, (input_ids[:, -1] * 7 + input_ids.shape[1]) % scores.shape[1]] += 4.0
        return scores


class StopOnToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


# ---------------------------------------------------------------- drawing cases
def _pick(rng, weighted):
    values, weights = zip(*weighted)
    return rng.choices(values, weights)[0]


def _model_fields(rng, total_len: int) -> dict:
    family = rng.choice(list(FAMILIES))
    heads, kv = rng.choice(HEADS)
    case = dict(family=family, heads=heads, kv_heads=kv, layers=rng.choice([1, 2, 2, 3]), model_seed=rng.randrange(1000),
                sharpness=rng.choice([1.0, 3.0]), sliding_window=None)
    slide = FAMILIES[family][3]
    if slide == "required" or (slide == "optional" and rng.random() < 0.5):
        # At or above the generation's length (beyond it the engine refuses, by design).
        case["sliding_window"] = total_len + rng.choice([0, 0, 1, 7, 4096])
    return case


def _magicdec_fields(rng, prompt_len: int, new_tokens: int) -> dict:
    draft = rng.choice(DRAFTS)
    m: dict = dict(draft=draft)
    if draft == "auto" and rng.random() < 0.5:
        return dict(draft="auto")  # everything "auto": the planner decides, maybe plain decoding
    m["gamma"] = _pick(rng, [(0, 1), (1, 2), (2, 2), (3, 2), (4, 2), (6, 1), ("auto", 2)])
    if m["gamma"] != "auto" and rng.random() < 0.2:
        m["adaptive_gamma"] = True
    if rng.random() < 0.3:
        m["max_gamma"] = rng.randint(1, 8)
    small = rng.random() < 0.6
    if rng.random() < 0.15:
        m["draft_budget"] = "auto"
    elif small:
        m["draft_budget"] = rng.randint(4, max(5, prompt_len - 1))
    else:
        m["draft_budget"] = prompt_len + new_tokens + rng.randint(0, 40)
    if draft in ("streamingllm", "dynamic", "attended", "auto"):
        m["sink_tokens"] = rng.choice([0, 1, 2, 4, 16])
    if draft in ("snapkv", "auto"):
        m["window"] = rng.choice([2, 4, 8, 32])
        if rng.random() < 0.4:
            m["recent_window"] = rng.randint(2, 24)
        if rng.random() < 0.3:
            m["pool_kernel"] = rng.choice([1, 3, 7])
    if draft in ("dynamic", "attended"):
        m["page_size"] = rng.choice([1, 2, 4, 8])
        if rng.random() < 0.5:
            m["recent_window"] = rng.randint(2, 24)
    if draft == "attended":
        m["window"] = rng.choice([2, 4, 8])
        m["every"] = rng.choice([1, 1, 2, 5])
    if draft in ("streamingllm", "snapkv") and rng.random() < 0.25:
        if rng.random() < 0.5:
            m["refresh_every"] = rng.randint(1, 6)
        else:
            m["refresh_below"] = rng.choice([0.5, 0.9, 0.99])
    if rng.random() < 0.3:
        m["prefill_chunk_size"] = rng.randint(3, 40)
    return m


def _valid(fields: dict) -> bool:
    """What ``MagicDecConfig`` and the view accept (with γ = 1 standing in for ``"auto"``, and a
    4,096-token budget for an ``"auto"`` budget with an explicit γ: the planner then chooses the
    budget, but no budget makes a rolling window hold more than its explicit ``recent_window``)."""
    cfg = {k: v for k, v in fields.items() if k != "prefill_chunk_size"}
    try:
        config = MagicDecConfig.from_any(**cfg)
    except ValueError:
        return False
    budget, gamma = cfg.get("draft_budget", "auto"), cfg.get("gamma", "auto")
    if budget == "auto" and gamma == "auto":
        return True  # the planner picks γ too (smaller ones first where the options rule one out), or declines
    # An "auto" draft may fall back to another view (its candidates, with the options each has);
    # with none that fits the explicit fields, generate refuses with a ValueError (tested apart).
    drafts = list(config.candidates) if config.draft == "auto" else [config.draft]
    for draft in drafts:
        try:
            # A resolved config checks its view against the budget and γ.
            config.replace(draft=draft, draft_budget=4096 if budget == "auto" else budget,
                           gamma=1 if gamma == "auto" else gamma)
            return True
        except ValueError:
            pass
    return False


def draw_case(seed: int, index: int) -> dict:
    """Case ``index`` of profile ``seed`` (a JSON-serialisable dict)."""
    rng = random.Random(f"{seed}:{index}")
    kind = _pick(rng, [("greedy", 60), ("sample", 32), ("dist", 8)])
    if kind == "dist":
        return _draw_dist_case(rng, seed, index)
    batch = rng.randint(1, 9)
    prompt_len = _pick(rng, [(rng.randint(1, 8), 1), (rng.randint(9, 40), 4), (rng.randint(41, 96), 3)])
    new_tokens = rng.randint(1, 40)
    case = dict(seed=seed, index=index, kind=kind)
    case.update(_model_fields(rng, prompt_len + new_tokens))
    case.update(batch=batch, prompt_len=prompt_len, left_padding=batch > 1 and rng.random() < 0.7,
                min_len=rng.randint(1, prompt_len), pass_mask=rng.random() < 0.8, prompt_seed=rng.randrange(10**6),
                new_tokens=new_tokens, use_max_length=rng.random() < 0.15)
    for _ in range(100):
        fields = _magicdec_fields(rng, prompt_len, new_tokens)
        if _valid(fields):
            break
    case["magicdec"] = fields
    gen: dict = {}
    if rng.random() < 0.3:
        gen["repetition_penalty"] = rng.choice([1.1, 1.3, 0.9])
    if rng.random() < 0.2:
        gen["no_repeat_ngram_size"] = rng.choice([2, 3])
    if rng.random() < 0.25:
        gen["min_new_tokens"] = rng.randint(1, 6)
    if rng.random() < 0.2:
        gen["bad_words_ids"] = rng.choice([[[rng.randrange(3, VOCAB)]],
                                           [[rng.randrange(3, VOCAB)], [rng.randrange(3, VOCAB), rng.randrange(3, VOCAB)]]])
    if rng.random() < 0.15:
        gen["suppress_tokens"] = rng.sample(range(3, VOCAB), rng.randint(1, 4))
    if rng.random() < 0.1:
        gen["begin_suppress_tokens"] = [rng.randrange(3, VOCAB)]
    if rng.random() < 0.1:
        gen["sequence_bias"] = [[[rng.randrange(3, VOCAB)], rng.choice([-4.0, 3.0])]]
    if rng.random() < 0.15:
        case["length_bias"] = True
    if kind == "sample":
        case["sample_seed"] = rng.randrange(10**6)
        gen["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        gen["top_k"] = _pick(rng, [(0, 2), (1, 1), (5, 1), (20, 1), (50, 2)])
        if rng.random() < 0.4:
            gen["top_p"] = rng.choice([0.8, 0.95])
        if rng.random() < 0.2:
            gen["min_p"] = rng.choice([0.02, 0.1])
        if rng.random() < 0.1:
            gen["typical_p"] = 0.9
        if rng.random() < 0.1:
            gen["epsilon_cutoff"] = 3e-4
        case["num_return_sequences"] = rng.choice([1, 1, 2, 3])
    case["generate"] = gen
    case["eos"] = _pick(rng, [("none", 2), ("default", 2), ("from_output", 4), ("list_from_output", 2)])
    if case["eos"] != "none" and rng.random() < 0.1:
        gen["forced_eos_token_id"] = EOS
    case["stop_strings"] = rng.random() < 0.15
    case["user_stop"] = rng.random() < 0.08
    return case


def _draw_dist_case(rng, seed, index) -> dict:
    prompt_len = rng.randint(6, 30)
    case = dict(seed=seed, index=index, kind="dist")
    case.update(_model_fields(rng, prompt_len + 3))
    case.update(prompt_len=prompt_len, prompt_seed=rng.randrange(10**6), sample_seed=rng.randrange(10**6))
    draft = rng.choice(["streamingllm", "snapkv", "dynamic", "attended"])
    fields = dict(draft=draft, draft_budget=rng.randint(3, max(4, prompt_len // 2)),
                  gamma=rng.choice([1, 2, 3, 4, "auto"]))
    if draft in ("streamingllm", "dynamic", "attended"):
        fields["sink_tokens"] = rng.choice([0, 1, 2])
    if draft in ("snapkv", "attended"):
        fields["window"] = rng.choice([4, 6])
    if draft in ("dynamic", "attended"):
        fields["page_size"] = rng.choice([1, 2])
    if not _valid(fields):
        fields = dict(draft="streamingllm", draft_budget=max(4, prompt_len // 2), sink_tokens=1, gamma=2)
    case["magicdec"] = fields
    gen = dict(temperature=rng.choice([0.7, 1.0, 1.4]), top_k=rng.choice([0, 0, 8]))
    if rng.random() < 0.4:
        gen["top_p"] = rng.choice([0.85, 0.95])
    if rng.random() < 0.3:
        gen["repetition_penalty"] = rng.choice([1.2, 0.8])
    if rng.random() < 0.2:
        gen["min_p"] = 0.05
    case["generate"] = gen
    return case


# ---------------------------------------------------------------- running cases
def _model_for(case, vocab=VOCAB, lm_scale=8.0):
    return build_model(case["family"], case["heads"], case["kv_heads"], case["layers"], case["model_seed"],
                       case["sharpness"], case["sliding_window"], vocab=vocab, lm_scale=lm_scale)


def _prompts(case):
    g = torch.Generator().manual_seed(case["prompt_seed"])
    batch, length = case["batch"], case["prompt_len"]
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if case["left_padding"]:
        for b in range(1, batch):
            real = int(torch.randint(case["min_len"], length + 1, (1,), generator=g))
            mask[b, : length - real] = 0
    ids[mask == 0] = PAD
    return ids, mask


def _generate(model, kwargs, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(**kwargs)


def _kwargs(case, ids, mask):
    gen = dict(case["generate"])
    if "sequence_bias" in gen:
        gen["sequence_bias"] = {tuple(toks): bias for toks, bias in gen["sequence_bias"]}
    kw = dict(input_ids=ids, do_sample=case["kind"] != "greedy", return_dict_in_generate=True, **gen)
    if case.get("pass_mask", True) or case.get("left_padding"):
        kw["attention_mask"] = mask
    if case.get("use_max_length"):
        kw["max_length"] = ids.shape[1] + case["new_tokens"]
    else:
        kw["max_new_tokens"] = case["new_tokens"]
    if case.get("num_return_sequences", 1) > 1:
        kw["num_return_sequences"] = case["num_return_sequences"]
    if case.get("length_bias"):
        kw["logits_processor"] = LogitsProcessorList([LengthBias()])
    return kw


def _resolve_stops(case, model, kw, P, rng):
    """EOS tokens, stop strings and a user stopping criterion taken from a stock run without them,
    so that they really fire in some rows."""
    kw["eos_token_id"] = None if case["eos"] in ("none", "from_output", "list_from_output") else [EOS]
    need_probe = case["eos"] in ("from_output", "list_from_output") or case["stop_strings"] or case["user_stop"]
    if not need_probe:
        return
    probe = _generate(model, {**kw, "eos_token_id": None, "forced_eos_token_id": None},
                      case.get("sample_seed")).sequences[:, P:]
    flat = probe.flatten().tolist()
    if case["eos"] == "from_output":
        kw["eos_token_id"] = rng.choice(flat)
    elif case["eos"] == "list_from_output":
        kw["eos_token_id"] = sorted({EOS, *rng.sample(flat, min(2, len(flat)))})
    if case["stop_strings"]:
        tok = char_tokenizer()
        row = probe[rng.randrange(probe.shape[0])].tolist()
        start = rng.randrange(len(row))
        piece = tok.decode([t for t in row[start : start + rng.randint(1, 3)] if t >= 3])
        kw["stop_strings"] = [piece or "zz", "qq"]
        kw["tokenizer"] = tok
    if case["user_stop"]:
        kw["stopping_criteria"] = StoppingCriteriaList([StopOnToken(rng.choice(flat))])
    if kw.get("forced_eos_token_id") is not None and kw["eos_token_id"] is None:
        kw["forced_eos_token_id"] = None


def _check_well_formed(case, kw, ids, out, stock):
    """Properties any lossless sampler's output has (sampling with drafting, no seeded equality)."""
    n = case.get("num_return_sequences", 1)
    P = ids.shape[1]
    max_len = P + case["new_tokens"]
    problems = []
    if out.shape[0] != ids.shape[0] * n:
        problems.append(f"rows {out.shape[0]} != {ids.shape[0] * n}")
    if not P < out.shape[1] <= max_len:
        problems.append(f"length {out.shape[1]} not in ({P}, {max_len}]")
    if not torch.equal(out[:, :P], ids.repeat_interleave(n, 0)):
        problems.append("prompts changed")
    if out.min() < 0 or out.max() >= VOCAB:
        problems.append("token outside the vocabulary")
    eos = kw.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    gen = case["generate"]
    stops = kw.get("stop_strings") or kw.get("stopping_criteria")
    new = out[:, P:]
    banned = set(gen.get("suppress_tokens", [])) | {w[0] for w in gen.get("bad_words_ids", []) if len(w) == 1}
    forced_last = kw.get("forced_eos_token_id") is not None and out.shape[1] == max_len  # overrides every ban
    for r, row in enumerate(new.tolist()):
        ends = [i for i, t in enumerate(row) if t in eos]
        end = ends[0] if ends else len(row)
        if forced_last and end >= len(row) - 1:  # the forced EOS at max_length is not an early stop
            row = row[:-1]
            ends = [i for i in ends if i < len(row)]
            end = ends[0] if ends else len(row)
        if ends and any(t != PAD for t in row[end + 1 :]):
            problems.append(f"row {r}: tokens after EOS")
        if ends and end < gen.get("min_new_tokens", 0):
            problems.append(f"row {r}: EOS at {end} before min_new_tokens")
        if banned & set(row[: end + 1]) - set(eos):
            problems.append(f"row {r}: banned token {sorted(banned & set(row[: end + 1]))}")
        # (A row may be empty here: one new token, the forced EOS at max_length, set aside above.)
        if gen.get("begin_suppress_tokens") and row and row[0] in gen["begin_suppress_tokens"]:
            problems.append(f"row {r}: begin-suppressed token first")
        ng = gen.get("no_repeat_ngram_size")
        if ng:
            kept = row[: end + 1]
            if stops and not ends:  # a stop string / criterion may have ended the row: padding follows
                while kept and kept[-1] == PAD:
                    kept = kept[:-1]
            full = out[r, :P].tolist() + kept
            seen = {tuple(full[i : i + ng]) for i in range(0, P - ng + 1)} if P >= ng else set()
            for i in range(max(0, P - ng + 1), len(full) - ng + 1):
                gram = tuple(full[i : i + ng])
                if i + ng > P and gram in seen:
                    problems.append(f"row {r}: repeated {ng}-gram {gram}")
                    break
                seen.add(gram)
    if not eos and not stops and out.shape[1] != max_len:
        problems.append(f"no EOS or stop, yet length {out.shape[1]} != {max_len}")
    return problems


def run_case(case: dict) -> dict:
    """Run one case; returns ``{"ok", "check", "seconds", "problem"}``."""
    t0 = time.perf_counter()
    if case["kind"] == "dist":
        result = _run_dist(case)
    else:
        result = _run_generation(case)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _run_generation(case):
    model = _model_for(case)
    ids, mask = _prompts(case)
    kw = _kwargs(case, ids, mask)
    rng = random.Random(f"stops:{case['seed']}:{case['index']}")
    _resolve_stops(case, model, kw, ids.shape[1], rng)
    seed = case.get("sample_seed")
    stock = _generate(model, kw, seed)
    ours = _generate(model, {**kw, "speculative": "magicdec", **case["magicdec"]}, seed)
    a, b = stock.sequences, ours.sequences
    spec = ours.speculation
    drafted = sum(sum(g) for g in spec.row_gammas) if getattr(spec, "row_gammas", None) else 0
    facts = dict(draft=spec.draft, drafted=drafted, acceptance=spec.acceptance_rate)
    if case["kind"] == "greedy":
        check = "greedy: equal to generate"
        problem = None if torch.equal(a, b) else _diff(a, b)
    elif drafted == 0:
        # Draw for draw like stock while every row is running; once a row finishes it leaves the
        # working batch and the RNG stream differs from stock's (same distribution, other draws).
        check = "sampling without drafting: seeded-equal to generate until a row finishes, then well-formed"
        end = ids.shape[1] + _first_possible_finish(a[:, ids.shape[1]:], kw) + 1
        problem = None if torch.equal(a[:, :end], b[:, :end]) else _diff(a[:, :end], b[:, :end])
        problem = problem or ("; ".join(_check_well_formed(case, kw, ids, b, a)[:5]) or None)
    elif case["generate"].get("top_k") == 1:
        check = "sampling, top_k=1 (deterministic): equal to generate"
        problem = None if torch.equal(a, b) else _diff(a, b)
    else:
        check = "sampling with drafting: well-formed"
        problems = _check_well_formed(case, kw, ids, b, a)
        problem = "; ".join(problems[:5]) or None
        if problem and _check_well_formed(case, kw, ids, a, a):
            # Stock's own output breaks a property too: the property is the checker's mistake.
            check, problem = "sampling with drafting: inconclusive (stock breaks the checked property too)", None
    return dict(ok=problem is None, check=check, problem=problem, **facts)


def _first_possible_finish(new, kw) -> int:
    """The first generated step at which some row of stock's output may have finished: an EOS,
    a padding token, the user criterion's token or the last character of a stop string."""
    eos = kw.get("eos_token_id")
    marks = {PAD} | set([] if eos is None else [eos] if isinstance(eos, int) else eos)
    if kw.get("stopping_criteria"):
        marks |= {c.token for c in kw["stopping_criteria"]}
    if kw.get("stop_strings"):
        vocab = char_tokenizer().get_vocab()
        marks |= {vocab[s[-1]] for s in kw["stop_strings"] if s[-1] in vocab}
    hit = torch.isin(new, torch.tensor(sorted(marks))).any(0).nonzero()
    return int(hit[0]) if len(hit) else new.shape[1]


def _diff(a, b):
    if a.shape != b.shape:
        return f"shapes differ: generate {tuple(a.shape)} vs magicdec {tuple(b.shape)}"
    where = (a != b).nonzero()
    r = int(where[0, 0])
    return (f"first differences at (row, col) {where[:4].tolist()}; row {r}:\n  generate: {a[r].tolist()}\n"
            f"  magicdec: {b[r].tolist()}")


def _run_dist(case):
    from scipy import stats

    model = _model_for(case, vocab=DIST_VOCAB, lm_scale=0.3)
    g = torch.Generator().manual_seed(case["prompt_seed"])
    P = case["prompt_len"]
    prompt = torch.randint(3, DIST_VOCAB, (P,), generator=g)
    ids = prompt.expand(DIST_ROWS, -1).clone()
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=True,
              eos_token_id=None, **case["generate"])
    stock = _generate(model, kw, case["sample_seed"])[:, P:]
    out = _generate(model, {**kw, "speculative": "magicdec", "return_dict_in_generate": True, **case["magicdec"]},
                    case["sample_seed"] + 1)
    ours = out.sequences[:, P:]
    pvalues = []
    for k in range(3):
        x = torch.bincount(stock[:, k], minlength=DIST_VOCAB)
        y = torch.bincount(ours[:, k], minlength=DIST_VOCAB)
        keep = (x + y) > 0
        if int(keep.sum()) < 2:
            pvalues.append(1.0)
            continue
        pvalues.append(float(stats.chi2_contingency(torch.stack([x[keep], y[keep]]).numpy()).pvalue))
    bad = [k for k, p in enumerate(pvalues) if p < DIST_P]
    problem = None if not bad else f"chi-square p-values {['%.2g' % p for p in pvalues]} (positions {bad})"
    return dict(ok=not bad, check="sampling: same distribution as generate (chi-square)", problem=problem,
                draft=out.speculation.draft, acceptance=out.speculation.acceptance_rate,
                min_p_value=round(min(pvalues), 5))


def reproduction(case: dict) -> str:
    return (f"python scripts/fuzz.py --seed {case['seed']} --case {case['index']}\n"
            f"case = {json.dumps(case, sort_keys=True)}")


def run_profile(cases: int, seed: int, start: int = 0, log=print, stop_on_fail=False) -> dict:
    """Run cases ``start .. start+cases-1`` of profile ``seed``; returns a summary."""
    t0 = time.perf_counter()
    failures, checks = [], {}
    for index in range(start, start + cases):
        case = draw_case(seed, index)
        try:
            result = run_case(case)
        except Exception:
            result = dict(ok=False, check="raised", problem=traceback.format_exc(limit=6), seconds=None)
        checks[result["check"]] = checks.get(result["check"], 0) + 1
        if not result["ok"]:
            failures.append((case, result))
            log(f"FAIL case {index} [{result['check']}]: {result['problem']}\n{reproduction(case)}")
            if stop_on_fail:
                break
        else:
            log(f"ok   case {index:4d} {case['kind']:6s} {case['family']:8s} {result['seconds']:6.2f}s "
                f"{result['check']}")
    return dict(seed=seed, cases=index - start + 1, failures=len(failures), checks=checks,
                seconds=round(time.perf_counter() - t0, 1), failed=failures)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--case", type=int, help="run only this case of --seed")
    ap.add_argument("--repro", help="run only this case dict (JSON, as printed on failure)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--stop-on-fail", action="store_true")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.repro or args.case is not None:
        case = json.loads(args.repro) if args.repro else draw_case(args.seed, args.case)
        print(json.dumps(case, sort_keys=True))
        result = run_case(case)
        print(json.dumps(result, indent=1, default=str))
        return 0 if result["ok"] else 1
    summary = run_profile(args.cases, args.seed, args.start, stop_on_fail=args.stop_on_fail)
    summary["failed"] = [dict(case=c, result=r) for c, r in summary["failed"]]
    summary.update(torch=torch.__version__, transformers=T.__version__, threads=args.threads)
    text = json.dumps({k: v for k, v in summary.items() if k != "failed"})
    print(f"SUMMARY {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
