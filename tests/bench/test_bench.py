"""``hf-magicdec bench``: argument checking before any load, and one small real run end to end
(SmolLM2 on Shakespeare) whose rows, identity flags and plots are checked."""

from __future__ import annotations

import json

import pytest
import torch

from hf_magicdec_bench.bench import BenchSpec
from hf_magicdec_bench.bench.cli import main as bench_main
from hf_magicdec_bench.bench.harness import Clock, measure
from hf_magicdec_bench.bench.runner import draft_name


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--batch", "0"], "batches"),
        (["--new-tokens", "1"], "new_tokens"),
        (["--gamma", "-2"], "gamma"),
        (["--draft", "nope"], "nope"),
        (["--budget", "20", "--gamma", "8"], "gamma + 1"),
        (["--dtype", "int8"], "int8"),
        (["--repeats", "0"], "repeats"),
    ],
)
def test_bad_arguments_fail_before_loading(monkeypatch, capsys, argv, fragment):
    from hf_magicdec_bench import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model despite bad arguments"))
    with pytest.raises(SystemExit) as exc:
        bench_main(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_budgets_that_hold_the_whole_generation_are_skipped():
    spec = BenchSpec(budgets=(64, 512), drafts=("streamingllm", "full"), gammas=(2,), new_tokens=64)
    configs = spec.configs(256)
    assert [(draft_name(c), c.draft_budget) for c in configs] == [("streamingllm", 64), ("full", 64), ("full", 512)]
    # A long generation outgrows a view that holds the prompt: that budget compresses from then on.
    long = BenchSpec(budgets=(256, 2048), drafts=("attended",), gammas=(2,), new_tokens=1024)
    assert [c.draft_budget for c in long.configs(256)] == [256]


def test_clock_splits_prefill_from_decode():
    class Fake:
        def __init__(self):
            self.calls = 0

        def __call__(self, clock):
            import time

            clock.put(torch.zeros(2, 5, dtype=torch.long))  # the prompt
            time.sleep(0.02)  # "prefill"
            clock.put(torch.zeros(2, dtype=torch.long))
            time.sleep(0.05)  # "decode"
            clock.put(torch.zeros(2, dtype=torch.long))
            clock.end()
            return torch.ones(2, 7, dtype=torch.long)

    m = measure(Fake(), repeats=3, device=torch.device("cpu"))
    assert 0.015 < m.prefill_s < m.decode_s and len(m.decode_all) == 3
    assert isinstance(Clock(), Clock)


@pytest.mark.slow
def test_bench_end_to_end_on_the_real_model(tmp_path, capsys):
    out = tmp_path / "bench"
    code = bench_main(["--batch", "2", "--context", "256", "--new-tokens", "6", "--draft", "streamingllm", "snapkv",
                       "--budget", "64", "96", "--gamma", "2", "--text", "shakespeare", "--out", str(out), "--quiet"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    methods = [r["method"] for r in rows]
    assert methods == ["stock", "own-ar"] + ["magicdec"] * 4
    for r in rows:
        assert r["decode_s"] > 0 and r["prefill_s"] > 0 and r["decode_tokens"] == 2 * 5
        assert r["env"]["torch"] == torch.__version__ and r["env"]["device_type"] == "cpu"
        if r["method"] != "stock":
            assert r["identical_to_generate"] is True
        if r["method"] == "magicdec":
            assert 0 <= r["acceptance_rate"] <= 1 and sum(r["accepted_histogram"]) >= 2
            assert set(r["breakdown"]) == {"steps", "draft_ms_per_step", "verify_ms_per_step", "other_ms_per_step"}
    assert (out / "throughput.png").stat().st_size > 0
    assert (out / "acceptance_vs_budget.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "identical" in printed and "NO" not in printed.split("identical", 1)[1]


def test_acceptance_command_checks_arguments_and_renders_a_table(monkeypatch, capsys):
    from hf_magicdec_bench import models
    from hf_magicdec_bench.bench import acceptance

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model despite bad arguments"))
    for argv, fragment in ((["--batch", "0"], "--batch"), (["--drafts", "nope"], "nope"), (["--gamma", "40"], "gamma")):
        with pytest.raises(SystemExit):
            acceptance.main(argv)
        assert fragment in capsys.readouterr().err
    rows = [dict(context=c, draft=d, budget=b, acceptance_rate=a, tokens_per_step=t, identical=True)
            for c, d, b, a, t in ((2048, "snapkv", 128, 0.8, 3.5), (2048, "streamingllm", 128, 0.7, 3.1),
                                  (4096, "snapkv", 128, 0.75, 3.3))]
    table = acceptance.markdown(rows).splitlines()
    assert table[0] == "| context | snapkv 128 | streamingllm 128 |"
    assert table[2] == "| 2048 | 0.800 (3.50) | 0.700 (3.10) |" and table[3] == "| 4096 | 0.750 (3.30) | - |"


@pytest.mark.slow
def test_ruler_mode_scores_both_paths_equally(tmp_path, capsys):
    out = tmp_path / "ruler"
    code = bench_main(["--ruler", "niah_single", "--context", "512", "--ruler-samples", "2", "--draft", "snapkv",
                       "--budget", "64", "--gamma", "2", "--out", str(out), "--quiet"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "ruler.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["stock generate", "magicdec snapkv/64 γ=2"]
    assert rows[1]["identical"] is True and rows[0]["accuracy"] == rows[1]["accuracy"]
    assert rows[0]["samples"] == 2 and 0 <= rows[1]["acceptance_rate"] <= 1
    assert "niah_single" in capsys.readouterr().out


def test_unknown_ruler_task_is_refused_before_loading(monkeypatch, capsys):
    from hf_magicdec_bench import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model despite bad arguments"))
    with pytest.raises(SystemExit):
        bench_main(["--ruler", "niah_single", "needle"])
    assert "needle" in capsys.readouterr().err


@pytest.mark.slow
def test_assisted_reference_runs_at_batch_one(tmp_path):
    """--assistant and --prompt-lookup add stock (batch 1), HF assisted generation and HF prompt lookup
    rows; the model drafts for itself here (same tokenizer, no second download), so the assisted
    output must equal stock's, as prompt lookup's must under greedy decoding."""
    out = tmp_path / "assisted"
    code = bench_main(["--batch", "2", "--context", "128", "--new-tokens", "6", "--draft", "snapkv", "--budget", "64",
                       "--gamma", "2", "--no-own-ar", "--assistant", "smollm2-135m", "--prompt-lookup", "3",
                       "--out", str(out), "--quiet"])
    assert code == 0
    rows = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(rows) == {"stock", "magicdec", "stock-b1", "assisted", "prompt-lookup"}
    for method in ("assisted", "prompt-lookup"):
        assert rows[method]["batch"] == 1 and rows[method]["identical_to_generate"] is True
        assert rows[method]["speedup_vs_stock"] > 0 and rows[method]["est_gb_per_s"] is None
    with pytest.raises(SystemExit):
        bench_main(["--prompt-lookup", "0", "--quiet"])


@pytest.mark.slow
def test_draft_model_runs_beside_self_speculation(tmp_path):
    """--draft-model adds MagicDec rows drafted by a separate model (here the model itself, loaded a
    second time: the same tokenizer without a second download) at the full batch size; with
    --share-prefill one target prefill serves every MagicDec run of a point."""
    out = tmp_path / "draft_model"
    code = bench_main(["--batch", "2", "--context", "128", "--new-tokens", "6", "--draft", "streamingllm", "snapkv",
                       "--budget", "64", "--gamma", "2", "--draft-model", "smollm2-135m", "--draft-model-view", "full",
                       "streamingllm", "--share-prefill", "--out", str(out), "--quiet"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # --share-prefill: SnapKV (the largest observation window) prefills first, own AR runs last and
    # every MagicDec row still reports its speedup over it; their prefill times are flagged.
    assert [r["label"] for r in rows][:3] == ["stock generate", "magicdec snapkv/64 γ=2",
                                              "magicdec streamingllm/64 γ=2"]
    assert rows[-1]["method"] == "own-ar" and len(rows) == 6
    assert all(r["speedup_vs_own_ar"] > 0 and r["prefill_shared"] for r in rows if r["method"] == "magicdec")
    small = [r for r in rows if r["label"].startswith("draft-model")]
    assert [r["label"] for r in small] == ["draft-model smollm2-135m full γ=2",
                                           "draft-model smollm2-135m streamingllm/64 γ=2"]
    assert all(r["batch"] == 2 and r["identical_to_generate"] is True for r in small)
    assert small[0]["acceptance_rate"] > 0.9  # the same weights on a full cache agree (up to fp ties)
    assert small[0]["est_gb_per_s"] is None  # the separate draft model's reads are not estimated
