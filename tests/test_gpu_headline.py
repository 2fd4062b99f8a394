"""The GPU headline (``scripts/gpu_headline.sh`` / ``scripts/gpu_headline.py``, docs/gpu_runs.md),
checked on CPU: the shell script parses, its dry run (``GPU_RUN_DRY=1``: ``--smoke``, a tiny random
Llama, the compiled rows on ``aot_eager``, one batch) measures every row and stage and writes the JSON, and the
GGUF travels in two parts that join only to the right digest."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_headline.sh"


def _headline():
    spec = importlib.util.spec_from_file_location("_script_gpu_headline", ROOT / "scripts" / "gpu_headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_headline_script_parses():
    assert shutil.which("bash")
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gguf_parts_join_only_to_the_right_digest(tmp_path):
    headline = _headline()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 40)
    headline.split_gguf(gguf, tmp_path / "a" / headline.PARTS[0], tmp_path / "b" / headline.PARTS[1], 1000)
    assert (tmp_path / "a" / headline.PARTS[0]).stat().st_size == 1000
    ok, why = headline.join_gguf([tmp_path / "a", tmp_path / "b"], tmp_path / "joined.gguf")
    assert (tmp_path / "joined.gguf").read_bytes() == gguf.read_bytes()
    assert not ok and "SHA-256" in why  # not SmolLM2's file: the run would say "RANDOM weights"
    ok, why = headline.join_gguf([tmp_path / "b"], tmp_path / "joined.gguf")
    assert not ok and headline.PARTS[0] in why


def test_dry_run_measures_every_row_and_stage(tmp_path):
    env = {**os.environ, "GPU_RUN_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    # One batch: the second of the smoke run's two repeats the same code at another shape.
    proc = subprocess.run(["bash", str(SCRIPT), "run", "--batches", "3"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "headline.json").read_text())
    assert report["complete"] and report["status"] == "done" and report["smoke"]
    assert (tmp_path / "log.txt").stat().st_size > 0
    for batch in report["batches"]:
        rows = {row["method"]: row for row in report["stages"][f"batch_{batch}"]}
        assert set(rows) == {"stock_static", "magicdec_default", "snapkv_256_g3", "gamma0"}
        for name, row in rows.items():
            assert "error" not in row, (batch, name, row.get("error"))
            assert row["decode_s"] > 0 and row["identical_to_stock_static"], (batch, name)
        assert rows["snapkv_256_g3"]["steps"] > 0 and rows["gamma0"]["gamma"] == 0
    assert report["stages"]["identity"]["identical"]
    ratios = report["stages"]["step_ratios"]
    assert ratios["capacity"] % 256 == 0 and ratios["capacity"] >= report["context"] + report["new_tokens"]
    assert ratios["td64_over_tt"] > 0 and ratios["tv3_over_tt"] > 0
    assert 0 < report["stages"]["bookkeeping"]["outside_ops_per_step"]
    assert {"speedup_snapkv_vs_compiled_static", "speculation_vs_gamma0"} <= set(report["verdict"])
