"""Compiled draft and verify steps (``compile=``): captured whole (``fullgraph=True``: no graph
break), identical output, and a bounded number of graphs over a generation whose rows finish at
different times. On CPU with the ``aot_eager`` backend (compiles fast; inductor is for GPUs)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import CompileConfig

from hf_magicdec import MagicDecConfig, MagicDecWarning
from hf_magicdec.engine.steps import ModelCall, compile_config_for

from conftest import EOS, make_model, ragged_prompts

CAPTURE = CompileConfig(backend="aot_eager", fullgraph=True)  # fullgraph: any graph break raises


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def _graphs(counters) -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("draft", [dict(draft="streamingllm", sink_tokens=2), dict(draft="snapkv", window=4)])
def test_compiled_steps_identical_with_bounded_graphs(fresh_dynamo, draft):
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=24, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=EOS)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", draft_budget=12, gamma=3, compile=CAPTURE,
                         return_dict_in_generate=True, **draft)
    assert torch.equal(reference, out.sequences)
    lengths = (out.sequences != 0).sum(1)
    assert len(set(lengths.tolist())) > 1, "rows must finish at different times for this test to mean something"
    # One graph per step kind (draft, verify) and batch regime (first batch, dynamic batch, one row):
    # not one per draft position, per context length or per step.
    assert 2 <= _graphs(fresh_dynamo) <= 6, dict(fresh_dynamo["stats"])
    # A second generation reuses the captured graphs (cached on the model by transformers).
    before = _graphs(fresh_dynamo)
    again = model.generate(**kwargs, speculative="magicdec", draft_budget=12, gamma=3, compile=CAPTURE, **draft)
    assert torch.equal(reference, again) and _graphs(fresh_dynamo) == before


def test_compiled_plain_decoding_on_our_cache(fresh_dynamo):
    """γ = 0 (asked for, or where adaptive γ lowers it) runs the verify region alone."""
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=24, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=EOS)
    out = model.generate(**kwargs, speculative="magicdec", draft="snapkv", draft_budget=12, window=4, gamma=0,
                         compile=CAPTURE, return_dict_in_generate=True)
    assert torch.equal(model.generate(**kwargs), out.sequences)
    assert out.speculation.steps > 0 and out.speculation.gamma == 0


def test_compiled_sampling_equals_eager_sampling(fresh_dynamo):
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(batch=2, length=20, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=20,
                  eos_token_id=None, speculative="magicdec", draft="streamingllm", draft_budget=10, sink_tokens=2,
                  gamma=2)
    torch.manual_seed(7)
    eager = model.generate(**kwargs, compile=False)
    torch.manual_seed(7)
    compiled = model.generate(**kwargs, compile=CAPTURE)
    assert torch.equal(eager, compiled)


def test_compiled_draft_model(fresh_dynamo):
    target, draft = make_model("llama-gqa3"), make_model("llama-gqa3", seed=5)
    ids, mask = ragged_prompts(batch=2, length=20, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    out = target.generate(**kwargs, speculative="magicdec", draft="full", draft_budget=64, gamma=3,
                          draft_model=draft, compile=CAPTURE)
    assert torch.equal(target.generate(**kwargs), out)


def test_compile_setting_resolution():
    gen = make_model("llama-gqa3").generation_config
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_config_for("auto", gen, cpu) is None  # on CPUs compiling does not pay
    assert compile_config_for("auto", gen, cuda) is not None
    assert compile_config_for(False, gen, cuda) is None
    assert compile_config_for(True, gen, cpu) is not None
    assert compile_config_for(CAPTURE, gen, cpu) is CAPTURE
    gen.disable_compile = True  # as stock generate: turns the automatic compile off
    assert compile_config_for("auto", gen, cuda) is None
    assert ModelCall.of(make_model("llama-gqa3")).compiled is None
    with pytest.raises(ValueError, match="compile must be"):
        MagicDecConfig(compile="always")
    assert MagicDecConfig.from_any(MagicDecConfig(compile=CAPTURE).to_dict()).compile.fullgraph


def test_step_timing_with_captured_steps(fresh_dynamo):
    """The GPU check times the steps as compile= runs them; on CPU the path must work (and capture)."""
    from hf_magicdec.calibration import measure_steps

    model = make_model("llama-gqa3")
    steps = measure_steps(model, 2, 96, gammas=(1, 3), budgets=(32, 64), repeats=1, compile_config=CAPTURE)
    assert steps.t_target > 0 and all(t > 0 for t in (*steps.t_verify.values(), *steps.t_draft.values()))
    assert _graphs(fresh_dynamo) >= 2  # the forwards really went through torch.compile


def test_compiled_batch_keeps_finished_rows_until_it_halves(fresh_dynamo):
    """Under compiled steps finished rows stay in the working batch (dead: they emit and count
    nothing) until at most half is alive, so batch sizes halve and graphs stay few; the output and
    each row's statistics are those of its live steps only."""
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(batch=8, length=24, seed=11)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False, eos_token_id=EOS)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", draft="streamingllm", draft_budget=12, sink_tokens=2,
                         gamma=3, compile=CAPTURE, return_dict_in_generate=True)
    assert torch.equal(reference, out.sequences)
    prompt = ids.shape[1]
    generated = [int(((out.sequences[r, prompt:] != 0)).sum()) for r in range(8)]
    assert min(generated) < max(generated)  # a row finishes early and stays in the batch, dead
    for row, accepted in enumerate(out.speculation.accepted_lengths):
        emitted = 1 + sum(a + 1 for a in accepted)  # the first token, then accepted + 1 per live step
        assert emitted >= generated[row] > emitted - (accepted[-1] + 1 if accepted else 1), (row, accepted)
    # Two compiled regions (draft, verify-to-commit), each in three batch regimes (the first
    # batch, a dynamic one, one row), and at most a few specialisations more: not one per batch.
    assert _graphs(fresh_dynamo) <= 8, dict(fresh_dynamo["stats"])


def test_static_buffer_addresses_follow_every_replacement(fresh_dynamo, monkeypatch):
    """Compiled on CUDA, the KV buffers are marked as static inputs (CUDA graphs then write them in
    place) as they are made: at prefill, when the views are built, and again whenever growth or
    compaction replaces them. Simulated on CPU by forcing the flag: output stays identical, every buffer the
    steps read is marked, and the graph count stays bounded as without the marks."""
    from hf_magicdec.engine import loop
    from hf_magicdec.engine.cache import CacheOptions, MagicDecCache

    marked: list[int] = []
    original = MagicDecCache._made

    def on_cuda(**options):  # the options a compiled generation gets on CUDA
        return CacheOptions(**{**options, "static_addresses": options["fixed_shapes"]})

    def counting(self, *buffers):
        marked.append(len(buffers))
        original(self, *buffers)

    monkeypatch.setattr(loop, "CacheOptions", on_cuda)
    monkeypatch.setattr(MagicDecCache, "_made", counting)
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=24, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=EOS)
    reference = model.generate(**kwargs)
    seen = []
    step = MagicDecCache.begin_verify

    def check(self, *args, **kwargs):
        for layer in self.layers:
            for t in (layer.keys, layer.values, layer.draft_keys, layer.draft_values):
                if t is not None and t.numel():
                    seen.append(getattr(t, "_dynamo_static_input_type", None) is not None)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(MagicDecCache, "begin_verify", check)
    # Marked where only the model forwards are compiled: a processor that reads the token history
    # keeps the step's bookkeeping eager (said once).
    kwargs["repetition_penalty"] = 1.1
    reference = model.generate(**kwargs)
    with pytest.warns(MagicDecWarning, match="only the model forwards are compiled"):
        out = model.generate(**kwargs, speculative="magicdec", draft="streamingllm", sink_tokens=2, draft_budget=12,
                             gamma=3, compile=CAPTURE)
    assert torch.equal(reference, out)
    assert len(marked) >= 3 and seen and all(seen)  # prefill, views, growth/compaction
    assert 2 <= _graphs(fresh_dynamo) <= 6, dict(fresh_dynamo["stats"])


def test_the_step_runs_in_compiled_regions_over_calls_of_different_shapes(fresh_dynamo, monkeypatch):
    """What a server does: calls of different batch sizes, prompt lengths and new-token counts in
    one process. The drafts, the verify, the acceptance, the emit and the commit run in compiled
    regions; what runs between them is a few operations per step; no call reaches dynamo's
    recompile limit (which would run the rest of the process eagerly) and tokens stay stock's."""
    import warnings

    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from hf_magicdec.engine import compiled, loop

    outside = {"ops": 0, "regions": 0, "steps": 0}

    class Outside(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            outside["ops"] += 1
            return func(*args, **(kwargs or {}))

    def counted_compile(fn, options):
        region = compiled_original(fn, options)

        def run(*args, **kwargs):  # the region's own operations are not counted
            outside["regions"] += 1
            with _disable_current_modes():
                return region(*args, **kwargs)
        return run

    compiled_original = compiled._compile
    monkeypatch.setattr(compiled, "_compile", counted_compile)
    monkeypatch.setattr(compiled, "_REGIONS", {})
    step = loop.Engine._captured_step

    def counting_step(self, *args):
        outside["steps"] += 1
        with Outside():
            return step(self, *args)

    monkeypatch.setattr(loop.Engine, "_captured_step", counting_step)
    model = make_model("llama-gqa3")
    per_call = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", MagicDecWarning)  # a recompile-limit warning fails the test
        for batch, prompt, new in [(3, 24, 40), (5, 40, 24), (2, 64, 30), (4, 32, 50), (6, 48, 20)]:
            ids, mask = ragged_prompts(batch=batch, length=prompt, seed=batch)
            kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=EOS)
            reference = model.generate(**kwargs)
            before = dict(outside)
            out = model.generate(**kwargs, speculative="magicdec", draft="streamingllm", draft_budget=16,
                                 sink_tokens=2, gamma=3, compile=CAPTURE)
            assert torch.equal(reference, out), (batch, prompt, new)
            steps = outside["steps"] - before["steps"]
            ops, regions = outside["ops"] - before["ops"], outside["regions"] - before["regions"]
            per_call.append((ops / steps, regions / steps))
    print("eager ops and compiled regions per step, per call:", per_call)
    assert all(ops <= 60 for ops, _ in per_call), per_call
    assert all(regions == 4 for _, regions in per_call), per_call  # γ draft regions and one verify region
    assert _graphs(fresh_dynamo) <= 16, dict(fresh_dynamo["stats"])  # shared by the calls, not one set per call
