"""``hf-magicdec bench --rounds N``: the rounds timing protocol on a tiny random model and tiny sizes.

Pinned: the order rotates each round; medians and spread come from the per-round numbers; the
busy-machine warning fires on a large spread (and only then); one stock prefill and one shared
MagicDec prefill serve every round; the table and the JSONL say which plan each MagicDec row ran.
"""

from __future__ import annotations

import json
import statistics
import types

import pytest
import torch
from conftest import VOCAB, make_model

from hf_magicdec import SpeculationStats
from hf_magicdec_bench.bench import rounds as rounds_mod
from hf_magicdec_bench.bench.cli import main as bench_main
from hf_magicdec_bench.bench.harness import Measurement
from hf_magicdec_bench.bench.report import breakdown_table, rounds_notes, table
from hf_magicdec_bench.bench.rounds import Method, busy_warning, rotation, spread
from hf_magicdec_bench.bench.runner import Result, plan_label, plan_ran

CONTEXT, BATCH, NEW = 96, 2, 6


# ----------------------------------------------------------------------------- pure parts
def test_rotation_puts_every_method_in_every_position():
    n = 4
    orders = [rotation(n, r) for r in range(n)]
    assert orders[0] == [0, 1, 2, 3] and orders[1] == [1, 2, 3, 0]
    for order in orders:
        assert sorted(order) == list(range(n))
    for method in range(n):  # over n rounds, each method runs once at each position
        assert sorted(order.index(method) for order in orders) == list(range(n))
    assert rotation(3, 4) == rotation(3, 1) and rotation(0, 2) == []


def test_spread_is_range_over_median():
    assert spread([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert spread([2.0, 2.2, 1.8, 2.0]) == pytest.approx(0.2)
    assert spread([5.0]) == 0.0 and spread([]) == 0.0


def _measurement(decode, prefill=0.1, accepted=None):
    stats = None
    if accepted is not None:
        stats = SpeculationStats(accepted_lengths=[[accepted]], gamma=3, draft="snapkv", draft_budget=256)
    return Measurement(prefill_s=prefill, decode_s=decode, prefill_all=[prefill], decode_all=[decode],
                       sequences=torch.ones(1, 4, dtype=torch.long), speculation=stats)


def test_aggregate_takes_medians_and_spread_from_the_rounds():
    m = Method("magicdec", "magicdec snapkv/256 γ=3", run=None, warm=None)
    # rounds finished in rotated positions, recorded out of round order: sorted back by round
    m.rounds = [(2, 0, _measurement(1.2, 0.3, accepted=3), {"cache_passed": False}),
                (0, 2, _measurement(1.0, 0.1, accepted=1), {"cache_passed": False}),
                (1, 1, _measurement(1.5, 0.2, accepted=2), {"cache_passed": False})]
    res = rounds_mod._aggregate(m, 1, 4, 4, torch.ones(1, 4, dtype=torch.long))
    assert res.m.decode_all == [1.0, 1.5, 1.2] and res.m.prefill_all == [0.1, 0.2, 0.3]
    assert res.m.decode_s == statistics.median([1.0, 1.5, 1.2]) == 1.2
    assert res.m.prefill_s == 0.2
    assert res.extra["decode_spread"] == pytest.approx((1.5 - 1.0) / 1.2)
    assert res.extra["decode_min_s"] == 1.0 and res.extra["decode_max_s"] == 1.5
    assert res.extra["round_position"] == [2, 1, 0] and res.extra["rounds"] == 3
    assert res.m.speculation.accepted_lengths == [[3]]  # the median round's statistics
    assert res.identical is True


def _row(label, decode_all, method="magicdec"):
    m = Measurement(prefill_s=0.1, decode_s=statistics.median(decode_all), prefill_all=[0.1] * len(decode_all),
                    decode_all=decode_all, sequences=torch.ones(1, 4, dtype=torch.long))
    r = Result(method, label, 1, 4, 4, m)
    r.extra.update(decode_spread=spread(decode_all), rounds=len(decode_all))
    return r


def test_breakdown_sets_the_planned_decode_speedup_beside_the_measured_one():
    """Per verification step, the speedup generate's plan predicted for the decode steps at the prior
    acceptance ("planned"), the model's at the measured one ("predicted") and what own AR measured."""
    r = _row("magicdec default plan", [2.0])
    r.m.speculation = SpeculationStats(accepted_lengths=[[3, 2]], gamma=3, steps=2, draft_seconds=0.6,
                                       verify_seconds=1.0, plan={"speculate": True, "predicted_speedup": 1.1,
                                                                 "predicted_decode_speedup": 1.23})
    r.predicted_speedup, r.speedup_vs_ar = 1.31, 1.27
    declined = _row("magicdec default plan", [2.0])
    declined.m.speculation = SpeculationStats(accepted_lengths=[[0]], gamma=3, steps=1, draft_seconds=0.0,
                                              verify_seconds=1.0, plan={"speculate": False,
                                                                        "predicted_decode_speedup": 0.8})
    text = breakdown_table([r, declined])
    head, first, second = [line for line in text.splitlines() if "planned" in line or "default plan" in line][:3]
    assert head.split()[-4:] == ["planned", "predicted", "vs", "AR"], head
    assert first.split()[-3:] == ["1.23x", "1.31x", "1.27x"], first
    assert second.split()[-3] == "-", second  # a declined plan predicted nothing for speculation
    assert "planned: the speedup over own AR that generate's plan of the call predicted" in text


def test_busy_warning_fires_on_a_large_spread_only():
    calm = [_row("stock generate", [1.0, 1.05, 0.98], "stock"), _row("magicdec a", [0.5, 0.52, 0.51])]
    assert busy_warning(calm) is None
    assert "WARNING" not in rounds_notes(calm)
    busy = calm + [_row("magicdec b", [0.5, 0.9, 0.55])]
    line = busy_warning(busy, load=(3.5, 3.0, 2.0))
    assert line.startswith("WARNING:") and "magicdec b 73%" in line and "magicdec a" not in line
    assert "busy" in line and "load average 3.50" in line
    assert any(x.startswith("WARNING:") for x in rounds_notes(busy).splitlines())
    assert busy_warning(busy, threshold=0.8) is None  # the threshold is what decides


def test_plan_label_names_what_ran():
    fixed = SpeculationStats(accepted_lengths=[[3]], gamma=3, draft="snapkv", draft_budget=256)
    assert plan_label(fixed) == "snapkv/256 γ=3 full"
    adaptive = SpeculationStats(accepted_lengths=[[1, 2]], gamma=2, draft="streamingllm", draft_budget=512,
                                draft_weights="int8", gamma_trace=[1, 2, 2], adaptive_gamma=True)
    assert plan_label(adaptive) == "streamingllm/512 γ≈1.7 int8"
    declined = SpeculationStats(accepted_lengths=[[]], draft="none (planner: plain decoding)")
    assert plan_label(declined) == "plain (declined)" and plan_ran(declined)["declined"] is True
    assert plan_ran(adaptive) == {"draft": "streamingllm", "draft_budget": 512, "gamma": 2, "mean_gamma": 1.667,
                                  "adaptive_gamma": True, "draft_weights": "int8", "declined": False}
    assert plan_label(None) == "-"


def test_bad_rounds_arguments_fail_before_loading(monkeypatch, capsys):
    from hf_magicdec_bench import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded a model despite bad arguments"))
    for argv, fragment in ((["--rounds", "0"], "rounds"), (["--rounds", "2", "--repeats", "2"], "repeats"),
                           (["--rounds", "2", "--assistant", "x"], "assistant"),
                           (["--rounds", "2", "--ruler", "niah_single"], "--ruler")):
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2
        assert fragment in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end, tiny model
@pytest.fixture
def tiny_bench(monkeypatch):
    """``hf-magicdec bench`` on a tiny random Llama: models.load and the prompt source patched; counts
    the prompt-length forwards (prefills) through the embedding."""
    from hf_magicdec_bench import data, models

    model = make_model("llama-gqa3", layers=2)
    monkeypatch.setattr(models, "load", lambda *a, **k: (model, types.SimpleNamespace(pad_token_id=0)))
    monkeypatch.setattr(data, "prompt_batch", lambda tok, b, c, source=None: torch.randint(
        3, VOCAB, (b, c), generator=torch.Generator().manual_seed(c)))
    prefills = []

    def count(module, args):
        if args and args[0].dim() == 2 and args[0].shape[1] >= CONTEXT - 1:
            prefills.append(tuple(args[0].shape))

    handle = model.model.embed_tokens.register_forward_pre_hook(count)
    yield model, prefills
    handle.remove()


def _bench(tmp_path, *extra):
    out = tmp_path / "out"
    code = bench_main(["--model", "tiny", "--batch", str(BATCH), "--context", str(CONTEXT), "--new-tokens", str(NEW),
                       "--draft", "streamingllm", "snapkv", "--budget", "48", "--gamma", "2", "--static-baseline",
                       "--out", str(out), "--quiet", *extra])
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return code, rows, out


def test_rounds_share_one_prefill_rotate_and_report(tmp_path, tiny_bench, capsys):
    _, prefills = tiny_bench
    code, rows, out = _bench(tmp_path, "--rounds", "3")
    assert code == 0
    labels = [r["label"] for r in rows]
    assert labels == ["stock generate", "stock generate, static cache", "own AR (gamma=0)",
                      "magicdec streamingllm/48 γ=2", "magicdec snapkv/48 γ=2"]
    # Two prefills of the prompts in all: stock's reference (from scratch) and the shared MagicDec one;
    # every round's stock and static call continues from a copy of the first, the others from the second.
    assert len(prefills) == 2, prefills
    n = len(rows)
    for i, r in enumerate(rows):
        assert r["rounds"] == 3 and len(r["decode_s_all"]) == 3
        assert r["round_position"] == [rotation(n, k).index(i) for k in range(3)]
        assert r["decode_s"] == statistics.median(r["decode_s_all"])
        assert r["decode_spread"] == pytest.approx(spread(r["decode_s_all"]))
        assert r["speedup_vs_stock"] == pytest.approx(rows[0]["decode_s"] / r["decode_s"])
        if r["method"] != "stock":
            assert r["identical_to_generate"] is True
            assert r["speedup_vs_static"] == pytest.approx(rows[1]["decode_s"] / r["decode_s"])
    assert rows[0]["identical_to_reference"] is True and rows[0]["reference_prefill_s"] > 0
    assert all(r["cache_reused"] for r in rows[:2])
    magic = [r for r in rows if r["method"] in ("own-ar", "magicdec")]
    assert all(r["prefill_shared"] and r["shared_prefill_s"] > 0 for r in magic)
    assert [r["plan_label"] for r in magic] == ["γ=0", "streamingllm/48 γ=2 full", "snapkv/48 γ=2 full"]
    assert magic[2]["plan_ran"]["draft"] == "snapkv" and magic[2]["plan_ran"]["draft_budget"] == 48
    assert magic[2]["round_plans"] == ["snapkv/48 γ=2 full"] * 3
    assert rows[0]["env"]["loadavg"] is None or len(rows[0]["env"]["loadavg"]) == 3
    printed = capsys.readouterr().out
    head = next(line for line in printed.splitlines() if "method" in line and "plan" in line)
    assert "spread" in head and "vs static" in head and "1st tok s" in head
    assert "snapkv/48 γ=2 full" in printed and "prefill, once for B=2 S=96" in printed
    assert (out / "throughput.png").stat().st_size > 0


def test_default_plan_row_says_what_the_planner_chose(tmp_path, tiny_bench):
    """At this size the planner declines: the row says so, and after the first (declined) round the
    default plan continues from stock's cache instead of prefilling again."""
    _, prefills = tiny_bench
    code, rows, _ = _bench(tmp_path, "--rounds", "3", "--default-plan", "--no-own-ar", "--draft", "snapkv")
    assert code == 0
    plan = rows[-1]
    assert plan["label"] == "magicdec default plan" and plan["identical_to_generate"] is True
    assert plan["config"]["draft"] == "auto" and plan["config"]["draft_weights"] == "auto"
    ran = plan["plan_ran"]
    assert set(ran) == {"draft", "draft_budget", "gamma", "mean_gamma", "adaptive_gamma", "draft_weights", "declined"}
    assert plan["plan_label"] == plan["round_plans"][1]
    if ran["declined"]:
        assert plan["plan_label"] == "plain (declined)"
        assert plan["round_cache_passed"] == [False, True, True]
        assert len(prefills) == 3  # reference, shared MagicDec prefill, the declined first round's own
    else:
        assert len(prefills) == 2


def test_rounds_off_keeps_the_sequential_protocol(tmp_path, tiny_bench):
    _, prefills = tiny_bench
    code, rows, _ = _bench(tmp_path, "--no-own-ar")
    assert code == 0
    assert [r["method"] for r in rows] == ["stock", "stock-static", "magicdec", "magicdec"]
    assert all("rounds" not in r for r in rows) and len(prefills) == 4  # every method prefills for itself
    assert rows[2]["plan_label"] == "streamingllm/48 γ=2 full" and rows[2]["speedup_vs_static"] > 0
    results = [_row("x", [1.0])]
    assert "plan" in table(results).splitlines()[0]


def test_sample_trace_keeps_positions_spread_over_the_generation():
    trace = [(n, 0.01 * n) for n in (1, 2, 5, 9, 10, 14, 17, 20)]  # MagicDec: several tokens per step
    kept = rounds_mod.sample_trace(trace, 20, points=4)  # every 5 tokens, the first step at or past each
    assert kept == [[5, 0.05], [10, 0.1], [17, 0.17], [20, 0.2]]
    assert rounds_mod.sample_trace([], 20) == []


def test_batch_trace_places_speculative_steps_at_the_mean_new_tokens_per_row():
    """Row 0 accepts little where row 1 accepts all: the position is the rows' mean, not row 0's."""
    stats = types.SimpleNamespace(steps=3, accepted_lengths=[[0, 0, 3], [3, 3, 3]])
    trace = [(1, 0.0), (2, 0.1), (3, 0.2), (7, 0.3)]  # row 0 streamed: 1 + 1 + 1 + 4 tokens
    assert rounds_mod.batch_trace(trace, stats, 10) == [(1.0, 0.0), (3.5, 0.1), (6.0, 0.2), (8.5, 0.3)]
    # capped at new_tokens, a finished row keeps its count
    stats = types.SimpleNamespace(steps=2, accepted_lengths=[[3, 3], [3]])
    assert rounds_mod.batch_trace([(1, 0.0), (5, 0.1), (6, 0.2)], stats, 6) == [(1.0, 0.0), (5.0, 0.1), (5.5, 0.2)]
    # stock (no statistics), or a trace that is not one entry per step: unchanged
    assert rounds_mod.batch_trace(trace, None, 10) is trace
    assert rounds_mod.batch_trace(trace[:2], types.SimpleNamespace(steps=3, accepted_lengths=[[0]]), 10) == trace[:2]


def test_stock_trace_counts_rows_that_stopped_at_eos_as_stopped():
    """EOS honoured: stock steps until the last row stops; the position is the rows' mean."""
    prompt = torch.full((2, 3), 5)
    generated = torch.tensor([[7, 2, 0, 0], [7, 7, 7, 7]])  # row 0 stops at EOS (2) after 2 tokens
    trace = [(k, 0.1 * k) for k in (1, 2, 3, 4)]
    ends = rounds_mod.row_tokens(torch.cat([prompt, generated], 1), 3, [2])
    out = rounds_mod.stock_trace(trace, ends)
    assert out == [(1.0, 0.1), (2.0, 0.2), (2.5, trace[2][1]), (3.0, trace[3][1])]
    assert rounds_mod.stock_trace(trace, None) is trace  # EOS ignored


def test_rows_that_stopped_at_eos_count_only_their_tokens():
    """tok/s, ms/tok and the bandwidth estimate of an EOS run count each row's tokens up to its EOS,
    not the padding after it (2 rows: 2 and 4 new tokens of 4)."""
    from hf_magicdec_bench.bench.harness import Measurement
    from hf_magicdec_bench.bench.runner import ModelInfo, Result, _bytes_read

    prompt = torch.full((2, 3), 5)
    seqs = torch.cat([prompt, torch.tensor([[7, 2, 0, 0], [7, 7, 7, 7]])], 1)
    assert rounds_mod.row_tokens(seqs, 3, [2]) == [2, 4]
    m = Measurement(prefill_s=1.0, decode_s=2.0, prefill_all=[1.0], decode_all=[2.0], sequences=seqs)
    full, eos = Result("stock", "stock", 2, 3, 4, m), Result("stock", "stock", 2, 3, 4, m, row_tokens=[2, 4])
    assert (full.decode_tokens, eos.decode_tokens) == (6, 4)
    assert (full.decode_tok_per_s, eos.decode_tok_per_s) == (3.0, 2.0)
    assert (full.ms_per_token, eos.ms_per_token) == (2000 / 3, 1000.0)
    info = ModelInfo(weight_bytes=100, kv_bytes_per_token=1)
    # 3 forwards either way (the long row); KV read: row 0 contexts 4 | row 1 contexts 4, 5, 6
    assert _bytes_read(info, full) == 300 + 2 * (4 + 5 + 6)
    assert _bytes_read(info, eos) == 300 + 4 + (4 + 5 + 6)


def test_window_schedule_gives_gamma_and_acceptance_over_the_generation():
    """Two rows, 4 steps: two plain steps, then γ = 2 (row 0 accepts 2 then 0, row 1 accepts 2
    twice); windows of 4 mean tokens per row."""
    stats = types.SimpleNamespace(steps=4, gamma_trace=[0, 0, 2, 2], accepted_lengths=[[0, 0, 2, 0], [0, 0, 2, 2]],
                                  row_gammas=[[0, 0, 2, 2], [0, 0, 2, 2]])
    assert rounds_mod.step_positions(stats, 12) == [1.0, 2.0, 3.0, 6.0, 8.0]
    # steps start at 1, 2 (window 0), 3 (window 0), 6 (window 1): γ 0, 0, 2 | 2
    assert rounds_mod.window_schedule(stats, 12, windows=3) == [[2.0, 0.667, 1.0], [6.0, 2.0, 0.5]]
    plain = types.SimpleNamespace(steps=2, gamma_trace=[0, 0], accepted_lengths=[[0, 0]], row_gammas=[[0, 0]])
    assert rounds_mod.window_schedule(plain, 4, windows=2) == [[1.0, 0.0, None], [3.0, 0.0, None]]
    assert rounds_mod.window_schedule(None, 4) == []


def test_position_speedups_compare_windows_against_the_static_cache():
    from hf_magicdec_bench.bench.report import position_speedups

    def row(method, label, seconds_per_token):  # a trace every 10 tokens: [position, seconds so far]
        clock, trace = 0.0, []
        for n, s in zip(range(10, 101, 10), seconds_per_token):
            clock += 10 * s
            trace.append([n, clock])
        return types.SimpleNamespace(method=method, label=label, new_tokens=100, config=None,
                                     extra={"position_trace": trace})

    static = row("stock-static", "static", [1.0] * 10)
    fast_late = row("magicdec", "m", [1.0] * 5 + [0.5] * 5)  # twice as fast per token from position 50 on
    ref, series = position_speedups([row("stock", "stock", [1.0] * 10), static, fast_late], windows=2)
    assert ref == "static" and set(series) == {"stock", "m"}
    (mid0, s0), (mid1, s1) = series["m"]
    assert (mid0, mid1) == (25, 75) and s0 == pytest.approx(1.0) and s1 == pytest.approx(2.0)


def test_long_generation_rows_carry_a_position_trace_and_plot(tmp_path, tiny_bench, monkeypatch):
    from hf_magicdec_bench.bench import report

    monkeypatch.setattr(report, "LONG_GENERATION", NEW)  # the tiny run counts as a long generation
    code, rows, out = _bench(tmp_path, "--rounds", "2")
    assert code == 0
    for r in rows:
        positions = [p for p, _ in r["position_trace"]]
        assert positions == sorted(positions) and positions[-1] == NEW  # every row's new tokens (EOS ignored)
        assert all(b >= a for (_, a), (_, b) in zip(r["position_trace"], r["position_trace"][1:]))
    assert (out / "speedup_vs_position.png").stat().st_size > 0
    magic = [r for r in rows if r["method"] == "magicdec"]
    assert all(r["gamma_schedule"] == [[1, r["breakdown"]["steps"], 2]] for r in magic)
    assert all(r["position_schedule"] and {g for _, g, _ in r["position_schedule"]} == {2.0} for r in magic)


def test_sampled_rounds_time_every_method_without_comparing_tokens(tmp_path, tiny_bench, capsys):
    """--temperature: every method samples (each round from one seed); rows are marked sampled, not
    identical or different, the MagicDec row still reports its acceptance."""
    code, rows, _ = _bench(tmp_path, "--rounds", "2", "--temperature", "1.0", "--draft", "snapkv")
    assert code == 0
    assert [r["label"] for r in rows] == ["stock generate", "stock generate, static cache", "own AR (gamma=0)",
                                          "magicdec snapkv/48 γ=2"]
    assert all(r["identical_to_generate"] is None and r["sampled"] is True for r in rows)
    assert 0 <= rows[-1]["acceptance_rate"] <= 1 and rows[-1]["rounds"] == 2
    out = capsys.readouterr().out
    assert "sampled at T=1" in out and "NOT IDENTICAL" not in out


def test_default_plan_alone_and_sampling_needs_rounds(tmp_path, tiny_bench, capsys):
    """--draft none --default-plan runs the default plan without an explicit view; sampling is timed
    with the rounds protocol only and is refused before loading anything otherwise."""
    code, rows, _ = _bench(tmp_path, "--rounds", "1", "--draft", "none", "--default-plan", "--no-own-ar")
    assert code == 0
    assert [r["label"] for r in rows] == ["stock generate", "stock generate, static cache", "magicdec default plan"]
    for bad in (["--temperature", "0.7"], ["--rounds", "1", "--temperature", "-1"], ["--rounds", "1", "--draft", "none"]):
        with pytest.raises(SystemExit) as exc:
            _bench(tmp_path, *bad)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "temperature" in err and "default_plan" in err


def test_a_default_plan_row_is_predicted_by_the_schedule_it_ran():
    """The default plan at 8 x 256 -> 768 ran attended/256 (the view compresses what the generation
    writes): its prediction is priced by the schedule adaptive γ ran, as generate priced the call. A
    pinned γ is priced at that γ, where a budget as long as the prompt compresses nothing."""
    from hf_magicdec import MagicDecConfig
    from hf_magicdec_bench.bench.runner import _predict

    model = make_model("llama-gqa3", layers=2)
    stats = types.SimpleNamespace(steps=114, draft="attended", mean_gamma=6.5, draft_budget=256,
                                  draft_weights="full", acceptance_rate=0.984)
    m = types.SimpleNamespace(speculation=stats)
    row = Result("magicdec", "magicdec default plan", 8, 256, 768, m, MagicDecConfig())
    _predict(model, row)
    assert row.predicted_speedup > 1.0 and row.extra["prediction"]["gamma"] >= 1
    pinned = Result("magicdec", "attended/256 γ=6", 8, 256, 768, m,
                    MagicDecConfig.from_any("magicdec", draft="attended", draft_budget=256, gamma=6))
    with pytest.raises(ValueError, match="nothing to compress"):
        _predict(model, pinned)
