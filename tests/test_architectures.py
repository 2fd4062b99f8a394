"""Architecture conformance sweep: every causal LM of the installed transformers, built tiny.

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny random-weight model from its
own config class with its features made to bite (soft-caps reached, sinks that matter, sliding
windows larger than the run, plus a rebuild with a window shorter than the run), a left-padded
ragged batch, and ``generate(speculative="magicdec")`` compared with stock greedy ``generate``. The
outcome must be identical tokens or a clear refusal before any forward pass; never a crash or a
silent mismatch. Architectures that cannot be built tiny, or whose stock ``generate`` fails, are
skipped with the reason. The helpers are in ``arch_sweep.py``; ``scripts/architecture_table.py``
writes the same results to ``docs/architectures.md``, which the last test keeps current.

All cases run once per session, in a spawn pool of 2 processes (about 2-3 minutes on 2 cores);
the parametrized tests only read the results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import arch_sweep

DOC = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
ARCHS = arch_sweep.architectures()
#: The transformers release the ≥ 90 target was set for.
TARGET_VERSION, TARGET_IDENTICAL = "5.23", 90


@pytest.fixture(scope="session")
def sweep_records():
    return arch_sweep.sweep(ARCHS, processes=2)


@pytest.fixture(scope="session")
def per_arch(sweep_records):
    return arch_sweep.summarize(sweep_records)


def _describe(record: dict) -> str:
    text = f"[{record['case']}] {record['status']}: {record['reason']}"
    if record.get("where"):
        text += f"\n    at {record['where']}"
    if record.get("notes"):
        text += f"\n    notes: {record['notes']}"
    return text


@pytest.mark.parametrize("model_type,class_name", ARCHS, ids=[mt for mt, _ in ARCHS])
def test_architecture(per_arch, model_type, class_name):
    entry = per_arch.get(model_type)
    assert entry is not None, f"{model_type}: the sweep returned no result"
    records = list(entry["cases"].values())
    bad = [r for r in records if r["status"] in ("mismatch", "crash")]
    assert not bad, f"{model_type} ({class_name}), attention kwargs {entry.get('attn_kwargs')}:\n" + "\n".join(
        _describe(r) for r in bad
    )
    if entry["status"] == "skipped":
        pytest.skip("; ".join(r["reason"] for r in records if r["status"] == "skipped"))
    for r in records:
        assert r["status"] in ("identical", "refused", "skipped"), _describe(r)
        if r["status"] == "refused":
            assert r["reason"].split(":")[0] in ("ValueError", "NotImplementedError") and len(r["reason"]) > 40


@pytest.mark.skipif(not transformers.__version__.startswith(TARGET_VERSION + "."),
                    reason=f"the identical-count target is for transformers {TARGET_VERSION}")
def test_identical_count(per_arch):
    identical = sorted(mt for mt, v in per_arch.items() if v["status"] == "identical")
    assert len(identical) >= TARGET_IDENTICAL, f"only {len(identical)} identical: {identical}"


def test_doc_is_current(sweep_records):
    """docs/architectures.md is generated (scripts/architecture_table.py), not hand-kept."""
    if not DOC.exists():
        pytest.fail(f"{DOC} is missing: run `{arch_sweep.DOC_COMMAND}`")
    recorded = arch_sweep.parse_markdown(DOC.read_text())
    if recorded["transformers"] != transformers.__version__:
        pytest.skip(f"docs/architectures.md was generated on transformers {recorded['transformers']}, "
                    f"this is {transformers.__version__}")
    current = arch_sweep.parse_markdown(arch_sweep.render_markdown(sweep_records))
    stale = {mt: (recorded["rows"].get(mt), row) for mt, row in current["rows"].items()
             if recorded["rows"].get(mt) != row}
    stale.update({mt: (row, None) for mt, row in recorded["rows"].items() if mt not in current["rows"]})
    assert not stale, (f"docs/architectures.md is out of date (model_type: (page, now)): {stale}; "
                       f"regenerate with `{arch_sweep.DOC_COMMAND}`")


def test_features_bite():
    """The tiny models exercise what they claim: without soft-capping / with zero sinks the output changes."""
    def greedy(model):
        ids, mask = arch_sweep.ragged_batch(3, arch_sweep.PROMPT_LEN, seed=0)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=arch_sweep.NEW_TOKENS,
                                  do_sample=False, pad_token_id=arch_sweep.PAD, eos_token_id=None)

    gemma2 = arch_sweep.build_tiny("gemma2", "Gemma2ForCausalLM")
    cap, max_logit = gemma2._sweep_softcap
    assert max_logit > 3 * cap
    capped = greedy(gemma2)
    for module in gemma2.modules():
        if hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None
    assert not torch.equal(capped, greedy(gemma2)), "soft-capping does not change gemma2's output"

    gpt_oss = arch_sweep.build_tiny("gpt_oss", "GptOssForCausalLM")
    with_sinks = greedy(gpt_oss)
    sinks = [m.sinks for m in gpt_oss.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    assert sinks and all(s.abs().min() >= 1 for s in sinks)
    with torch.no_grad():
        for s in sinks:
            s.fill_(-1e4)  # a sink that takes no probability mass: plain softmax
    assert not torch.equal(with_sinks, greedy(gpt_oss)), "sinks do not change gpt_oss's output"
