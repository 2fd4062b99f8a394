"""``scripts/dtype_agreement.py`` (docs/faq.md, "How close is 16-bit output?") runs and its table holds.

The smoke mode (a tiny random Llama, random prompts) runs as a subprocess, as a user would: the
markdown table has its columns and every pair, the JSONL agrees with it, and in fp32 every pair
(stock batch 1 vs batch N, stock vs MagicDec) agrees completely, which is the library's exactness
claim. 16-bit rows are only checked for form: whether they agree is what the script measures.
The metric helpers are checked on hand-made decodings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "dtype_agreement.py"
sys.path.insert(0, str(SCRIPT.parent))
import dtype_agreement  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _table(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_help():
    text = dtype_agreement.build_parser().format_help()  # in-process: the smoke run below is the subprocess
    assert "--smoke" in text and "--dtypes" in text and "--out" in text


def test_smoke_table_and_fp32_agreement(tmp_path):
    proc = _run("--smoke", "--dtypes", "bf16", "--batch", "3", "--new-tokens", "12", "--quiet", "--out", str(tmp_path))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"

    rows = _table(proc.stdout)
    assert rows[0] == dtype_agreement.COLUMNS, rows[0]
    assert set(rows[1]) <= {"---"}
    body = rows[2:]
    assert all(len(r) == len(dtype_agreement.COLUMNS) for r in body)
    views = ["streamingllm/32", "snapkv/48", 'default plan (speculative="magicdec")']
    expected = {"fp32": 1 + 2 * len(views), "bf16": 1 + 2 + 3 * len(views)}  # (a); (b) x2; (c), (d), (e) per view
    assert {d: sum(r[0] == d for r in body) for d in expected} == expected
    for dtype in expected:
        pairs = [r[1] for r in body if r[0] == dtype]
        assert pairs[0] == "(a) stock batch 1 vs stock batch N"
        for view in views:
            assert any(p.startswith(f"(c) stock batch N vs MagicDec {view}") for p in pairs), (dtype, view, pairs)
            assert any(p.startswith(f"(d) stock batch 1 vs MagicDec {view}") for p in pairs), (dtype, view, pairs)
    for r in body:
        identical, total = map(int, r[2].split("/"))
        assert total == 3 and 0 <= identical <= 3
        assert 0.0 <= float(r[4]) <= 1.0 and r[6].endswith("%")

    # fp32 is exact: every pair identical over the whole generation.
    for r in body:
        if r[0] == "fp32":
            assert r[2] == "3/3" and r[3] == "—" and r[4] == "1.00" and r[5] == "0" and r[6] == "0.0%", r

    records = [json.loads(line) for line in (tmp_path / "dtype_agreement.jsonl").read_text().splitlines()]
    meta, pairs = records[0], records[1:]
    assert meta["record"] == "meta" and meta["smoke"] and meta["dtypes"] == ["fp32", "bf16"]
    assert meta["prompt_lengths"] == sorted(meta["prompt_lengths"], reverse=True) and len(set(meta["prompt_lengths"])) == 3
    assert len(pairs) == len(body)
    for rec, r in zip(pairs, body):
        assert rec["pair"] == r[1] and len(rec["rows"]) == 3
        assert all(row["new_tokens"] == 12 for row in rec["rows"])
        if rec["dtype"] == "fp32":
            assert all(row["first_divergence"] is None and row["differing"] == 0 for row in rec["rows"])
    assert (tmp_path / "table.md").read_text().startswith("| dtype |")
    assert any(line.startswith("bf16 streamingllm/32") for line in proc.stdout.splitlines())


def test_metrics_on_hand_made_decodings():
    ref = [torch.tensor([5, 6, 7, 8]), torch.tensor([1, 2, 3, 4])]
    other = [torch.tensor([5, 6, 9, 8]), torch.tensor([1, 2, 3, 4])]
    logits = [torch.zeros(4, 10), torch.zeros(4, 10)]
    logits[0][2, 7], logits[0][2, 9] = 16.0, 15.875  # bf16 spacing at 16 is 0.125: a one-ulp gap
    rows = dtype_agreement.compare(ref, other, logits, "bf16")
    assert rows[0]["first_divergence"] == 2 and rows[0]["differing"] == 1 and rows[0]["gap_ulp"] == 1.0
    assert rows[1]["first_divergence"] is None and rows[1]["gap"] is None
    s = dtype_agreement.summarize(rows)
    assert s["rows_identical"] == 1 and s["first_divergence_min"] == 2
    assert s["mean_agreed_prefix"] == (2 / 4 + 1) / 2
    assert s["divergences_per_1k"] == round(1000 * 1 / (3 + 4), 2)  # positions at risk: 0..2 of row 0, all of row 1
    assert s["differing_fraction"] == 1 / 8
    assert dtype_agreement.prompt_lengths(3, 256, 512) == [512, 384, 256]
    ids, mask = dtype_agreement.ragged([torch.tensor([1, 2, 3]), torch.tensor([4])], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
