"""MagicDec rollouts in TRL's ``GRPOTrainer`` (``use_vllm=False``), on tiny random models.

TRL (1.16) generates with
``unwrapped_model.generate(**inputs, generation_config=GenerationConfig(**defaults, **args.generation_kwargs))``,
the model in training mode (never switched to eval), gradient checkpointing turned off around the
call and back on after it. So the MagicDec settings reach ``generate`` only as attributes of that
``GenerationConfig``, two ways:

* ``flat``: the issue's ``generation_kwargs={"speculative": "magicdec", "draft": ..., "draft_budget": ...,
  "sink_tokens": ..., "gamma": ...}``: every option an attribute of its own;
* ``nested``: ``generation_kwargs={"speculative": {"method": "magicdec", "draft": ..., ...}}``.

Each test runs one GRPO step (``max_steps=1``) and checks, for every rollout ``generate`` call:
the MagicDec engine ran (a call sent to stock decoding never reaches it), the rollouts are
those of the same run without the MagicDec settings (greedy) or follow the target distribution
(sampling, chi-square on a 12-token vocabulary), and the model is left exactly as TRL expects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from conftest import make_model
from datasets import Dataset
from integration_utils import (
    ModelState,
    checkpointing,
    counting_engine_runs,
    exact_marginals,
    goodness_of_fit,
    text_prompts,
    word_tokenizer,
)
from trl import GRPOConfig, GRPOTrainer

VOCAB = 128
SPEC = {"draft": "streamingllm", "draft_budget": 32, "sink_tokens": 4, "gamma": 3}  # the settings



def _flat(**gen):
    return {**gen, "speculative": "magicdec", **SPEC}


def _nested(**gen):
    return {**gen, "speculative": {"method": "magicdec", **SPEC}}


FORMS = [pytest.param(_flat, id="flat"),
         pytest.param(_nested, id="nested")]


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@dataclass
class Call:
    """One rollout ``generate`` call made by TRL."""

    input_ids: torch.Tensor
    sequences: torch.Tensor
    before: ModelState
    after: ModelState
    trl_config_before: dict
    trl_config_after: dict


@dataclass
class GRPORun:
    calls: list[Call]
    engine_runs: int
    model: object  # what TRL generated with (trainer.model: the model, or its PeftModel)


def grpo_step(tmp_path, generation_kwargs, *, model, tokenizer, prompts, num_generations, batch,
              max_completion_length, peft_config=None, seed=0) -> GRPORun:
    """One GRPO step (CPU, ``use_vllm=False``, gradient checkpointing on) recording every rollout call.
    ``bf16=False``: TRL's default ``bf16=True`` runs the forwards under bf16 autocast (on CPU too), where
    token identity is not promised (a verify forward rounds differently from one-token steps: FAQ)."""
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=batch, num_generations=num_generations,
        max_completion_length=max_completion_length, generation_kwargs=generation_kwargs, use_vllm=False,
        gradient_checkpointing=True, use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
        seed=seed, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), peft_config=peft_config)
    target = trainer.model
    generate = type(target).generate
    calls: list[Call] = []

    def recording_generate(*a, **kw):
        before, config = ModelState.of(target), copy.deepcopy(kw["generation_config"].to_dict())
        out = generate(target, *a, **kw)
        calls.append(Call(kw["input_ids"].clone(), out.clone(), before, ModelState.of(target), config,
                          kw["generation_config"].to_dict()))
        return out

    target.generate = recording_generate  # TRL calls unwrapped_model.generate: this very object here
    try:
        with counting_engine_runs() as runs:
            trainer.train()
    finally:
        del target.generate
    assert calls, "TRL made no rollout generate call"
    return GRPORun(calls, runs.engine, target)


def _greedy_run(tmp_path, generation_kwargs, **extra):
    return grpo_step(tmp_path, generation_kwargs, model=make_model("llama-gqa3", seed=0),
                     tokenizer=word_tokenizer(VOCAB), prompts=text_prompts((40, 56), VOCAB, seed=1),
                     num_generations=2, batch=4, max_completion_length=16, **extra)


def _lora():
    """Non-zero adapters (``init_lora_weights=False``), so that they change the rollouts."""
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights=False)


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """One GRPO step per setting, shared by the tests (a step takes seconds): ``greedy("stock")``,
    ``greedy(_flat)``, ``greedy(_nested)``, ``greedy(_nested, lora=True)``."""
    done: dict = {}

    def get(form, lora: bool = False) -> GRPORun:
        key = (getattr(form, "__name__", form), lora)
        if key not in done:
            kwargs = {"do_sample": False} if form == "stock" else form(do_sample=False)
            extra = {}
            if lora:
                torch.manual_seed(0)  # the adapters' initialisation
                extra["peft_config"] = _lora()
            done[key] = _greedy_run(tmp_path_factory.mktemp("grpo"), kwargs, **extra)
        return done[key]

    return get


@pytest.mark.parametrize("form", FORMS)
def test_grpo_rollouts_run_the_magicdec_engine(form, greedy):
    run = greedy(form)
    assert run.engine_runs == len(run.calls), (
        f"the MagicDec engine ran {run.engine_runs} times for {len(run.calls)} rollout generate calls")


@pytest.mark.parametrize("form", FORMS)
def test_grpo_greedy_rollouts_identical_to_stock(form, greedy):
    run, stock = greedy(form), greedy("stock")
    assert run.engine_runs == len(run.calls)
    assert len(run.calls) == len(stock.calls)
    for ours, theirs in zip(run.calls, stock.calls, strict=True):
        assert torch.equal(ours.input_ids, theirs.input_ids)  # same prompts, same order (same seed)
        assert (ours.input_ids == 0).any(), "the rollout batch should be ragged (left padding)"
        assert torch.equal(ours.sequences, theirs.sequences)


@pytest.mark.parametrize("form", FORMS)
def test_grpo_leaves_the_model_as_trl_expects(form, greedy):
    """Around every rollout call nothing changes (training flags of every module, checkpointing
    flags, attention implementation, ``config.use_cache``, generation configs, parameters,
    ``requires_grad``, gradients); TRL generates in training mode with checkpointing off and turns
    it back on afterwards."""
    run = greedy(form)
    assert run.engine_runs == len(run.calls)
    for i, call in enumerate(run.calls):
        call.before.assert_same(call.after, f"rollout call {i}")
        assert call.trl_config_before == call.trl_config_after, "TRL's GenerationConfig was modified"
        assert all(call.before.training.values()), "TRL generates in training mode"
        assert not call.before.checkpointing
    assert run.model.training and checkpointing(run.model)


def test_grpo_lora_rollouts_identical_to_stock(greedy):
    """``GRPOTrainer(peft_config=LoraConfig(...))``: TRL generates with the PeftModel (nested form;
    the flat form's routing is the same as without PEFT)."""
    stock, ours = greedy("stock", lora=True), greedy(_nested, lora=True)
    assert type(ours.model).__name__.startswith("Peft")
    assert ours.engine_runs == len(ours.calls)
    plain = greedy("stock")
    assert not all(torch.equal(a.sequences, b.sequences) for a, b in zip(stock.calls, plain.calls, strict=True)), \
        "the adapters should change the rollouts"
    for a, b in zip(ours.calls, stock.calls, strict=True):
        assert torch.equal(a.sequences, b.sequences)
        a.before.assert_same(a.after, "LoRA rollout call")
    assert ours.model.training and checkpointing(ours.model)


@pytest.mark.parametrize("form", FORMS)
def test_grpo_sampled_rollouts_follow_the_target_distribution(tmp_path, form):
    """Temperature 1.0 rollouts of one prompt (12-token vocabulary, EOS honoured): the marginals of
    generated tokens 0..2 fit the model's exact distribution (chi-square), as stock sampling does.
    Budget 8 of a 24-token prompt: the draft differs from the target, so drafts get rejected."""
    rows, steps = 800, 3
    spec = {"draft": "streamingllm", "draft_budget": 8, "sink_tokens": 2, "gamma": 2}
    kwargs = form(do_sample=True, temperature=1.0)
    if isinstance(kwargs["speculative"], dict):
        kwargs["speculative"] = {"method": "magicdec", **spec}
    else:
        kwargs.update(spec)
    run = grpo_step(tmp_path, kwargs, model=_softened(seed=4), tokenizer=word_tokenizer(12),
                    prompts=text_prompts((24,), 12, seed=2), num_generations=rows, batch=rows,
                    max_completion_length=steps, seed=3)
    assert run.engine_runs == len(run.calls) == 1
    call = run.calls[0]
    prompt = call.input_ids[0]
    assert (call.input_ids == prompt).all()
    exact = exact_marginals(_softened(seed=4), prompt, steps)  # the model as it was before the step
    new = call.sequences[:, prompt.shape[0]:]
    for k in range(steps):
        p = goodness_of_fit(new[:, k], exact[k])
        assert p > 1e-3, (k, p, torch.bincount(new[:, k], minlength=12), exact[k] * rows)


def _softened(seed: int):
    """A 12-token model with soft logits: a spread distribution exercises every branch of the sampler."""
    model = make_model("llama-gqa3", seed=seed, vocab_size=12)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.2)
    return model
