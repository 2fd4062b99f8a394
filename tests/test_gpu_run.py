"""The one-call GPU run (``scripts/gpu_run.sh``, docs/kernels.md "Running on a lent GPU"), checked on
CPU: the shell script parses and its dry run (``GPU_RUN_DRY=1``: gpu_check in ``--smoke`` mode through
Triton's interpreter) writes the JSON, the markdown and the log; the markdown renderer
(``scripts/gpu_report.py``) on a smoke JSON, whole and cut short; and the wheel preparation's size
accounting and requirement check (``scripts/prepare_gpu_wheels.py``; not its download: the suite is
offline). ``tests/data/gpu_check_smoke.json`` is the output of
``TRITON_INTERPRET=1 python scripts/gpu_check.py --smoke --models llama-3.1-8b``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
SMOKE_JSON = Path(__file__).parent / "data" / "gpu_check_smoke.json"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("gpu_report")
wheels = _load("prepare_gpu_wheels")


def test_gpu_run_script_parses():
    assert shutil.which("bash"), "bash is needed to run scripts/gpu_run.sh"
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_run.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_report_renders_a_smoke_json():
    data = json.loads(SMOKE_JSON.read_text())
    md = report.render(data)
    assert md.startswith("# GPU check\n")
    for heading in ("## Verdict", "## Kernel correctness", "## Verify attention over the full cache",
                    "## Step times (engine forwards)", "## Stock decode step", "## End to end",
                    "## Draft views and long generation (issue 26"):
        assert heading in md, heading
    assert "| Triton kernels match the fp32 twin (bf16, fp16) | yes | – | – |" in md
    assert "partial" not in md
    # Every measured shape is one row; eager and captured steps are told apart; γ and budgets as columns.
    step_rows = [line for line in md.splitlines() if line.startswith("| llama-3.1-8b | 2 | 256 | ")]
    assert len(step_rows) == 3  # eager, captured, stock decode step
    assert any("| eager |" in r for r in step_rows) and any("| captured |" in r for r in step_rows)
    assert "T_V(4)/T_T" in md and "T_D(512)/T_T" in md and "T_D(512) quantized" in md
    # Every table row has as many cells as its header.
    for block in md.split("\n\n"):
        lines = [line for line in block.splitlines() if line.startswith("|")]
        if lines:
            assert len({line.count(" | ") for line in lines}) == 1, block


def test_report_renders_a_run_cut_short(tmp_path):
    data = json.loads(SMOKE_JSON.read_text())
    for key in ("kernel", "model", "end_to_end"):
        data.pop(key)
    data.update(complete=False, status="stopped by signal 15",
                skipped=[dict(model="llama-3.1-8b", batch=32, context=32768, graphs=True)])
    data["verdict"] = dict.fromkeys(data["verdict"])
    data["verdict"]["correctness"] = True
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "partial.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    md = out.read_text()
    assert "stopped by signal 15 (partial: stopped before the end)" in md
    assert "## Step times" not in md and "## Skipped (time budget)" in md
    assert "- model=llama-3.1-8b, batch=32, context=32768, graphs=True" in md


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_travel_size_counts_tracked_untracked_and_carried_files(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / ".gitignore").write_text("/.whl/\n/big.bin\n")
    (repo / "src" / "tracked.py").write_bytes(b"x" * 1000)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    (repo / "untracked.txt").write_bytes(b"y" * 500)  # untracked, not ignored: travels
    (repo / "big.bin").write_bytes(b"z" * 100_000)  # ignored: stays
    (repo / ".whl").mkdir()
    (repo / ".whl" / "pkg-1.0-py3-none-any.whl").write_bytes(b"w" * 2000)  # ignored but carried

    sizes = wheels.travel_bytes(repo, (".whl",))
    gitignore = len("/.whl/\n/big.bin\n")
    assert sizes["tree"] == 1000 + 500 + gitignore
    assert sizes[".whl"] == 2000 and sizes["shared"] == 0
    assert sizes["total"] == 1000 + 500 + gitignore + 2000

    assert wheels.check_size(repo, (".whl",), limit=10_000) == 0
    assert "MiB of headroom" in capsys.readouterr().out
    assert wheels.check_size(repo, (".whl",), limit=3_000) == 1
    assert "OVER" in capsys.readouterr().err


def _fake_wheel(path: Path, requires: list[str]) -> Path:
    name, version = path.name.split("-")[:2]
    with zipfile.ZipFile(path, "w") as zf:
        meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        zf.writestr(f"{name}-{version}.dist-info/METADATA",
                    "\n".join(meta + [f"Requires-Dist: {r}" for r in requires]) + "\n")
    return path


def test_requirements_are_checked_against_the_image(tmp_path):
    # transformers 5.23.0's own requirements (its METADATA): the image satisfies every one.
    t523 = _fake_wheel(tmp_path / "transformers-5.23.0-py3-none-any.whl", [
        "huggingface-hub<3.0,>=1.31.0", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1", "regex>=2025.10.22",
        "tokenizers<0.24.0,>=0.23.1", "typer", "safetensors>=0.8.0", "tqdm>=4.60",
        "accelerate>=1.1.0; extra == 'torch'", "pytest; extra == 'testing'", "colorama; sys_platform == 'win32'"])
    needed, notes = wheels.plan([t523])
    assert needed == []
    assert len(notes) == 9 and all(n.endswith("(ok)") for n in notes)

    # A newer hub than the image's 1.33.0 is carried; a carried wheel satisfies its dependant.
    newer = _fake_wheel(tmp_path / "transformers-9.0.0-py3-none-any.whl", ["huggingface-hub>=1.40", "numpy>=1.17"])
    assert wheels.plan([newer])[0] == ["huggingface-hub>=1.40"]
    hub = _fake_wheel(tmp_path / "huggingface_hub-1.41.0-py3-none-any.whl", [])
    assert wheels.plan([newer, hub])[0] == []

    # gguf 0.19.0 (the headline run's loader): lower bounds at or below what the image meets are met.
    gguf = _fake_wheel(tmp_path / "gguf-0.19.0-py3-none-any.whl", ["numpy>=1.17", "pyyaml>=5.1", "requests>=2.25",
                                                                   "tqdm>=4.27"])
    assert wheels.plan([gguf])[0] == []

    # Unknown versions fail loudly, and so does a need for another torch than the image's.
    with pytest.raises(SystemExit, match="cannot tell"):
        wheels.plan([_fake_wheel(tmp_path / "a-1.0-py3-none-any.whl", ["regex>=2026.1"])])
    with pytest.raises(SystemExit, match="cannot tell"):
        wheels.plan([_fake_wheel(tmp_path / "d-1.0-py3-none-any.whl", ["tqdm>=4.27,<4.50"])])
    with pytest.raises(SystemExit, match="cannot tell"):
        wheels.plan([_fake_wheel(tmp_path / "b-1.0-py3-none-any.whl", ["no-such-package"])])
    with pytest.raises(SystemExit, match="is what is measured"):
        wheels.plan([_fake_wheel(tmp_path / "c-1.0-py3-none-any.whl", ["torch>=2.13"])])


def test_gpu_run_dry_run_writes_json_markdown_and_log(tmp_path):
    """The whole script on CPU (GPU_RUN_DRY=1), run once for the suite: versions, then gpu_check in
    --smoke mode (one model shape; the GPU run covers both) through every stage, the markdown table and
    the log."""
    out = tmp_path / "out"
    env = {**os.environ, "GPU_RUN_DRY": "1", "PYTHON": sys.executable, "OUT": str(out)}
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_run.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "log.txt"]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["complete"] is True and data["smoke"] is True and data["verdict"]["correctness"] is True
    assert data["skipped"] == []
    assert {r["path"] for r in data["kernel"]} == {"triton", "torch_twin", "stock_sdpa", "triton_mass16"}
    # The verify kernel's mass per page (draft="attended") is checked, and the views stage's
    # long-generation rows ran without error and decoded what plain decoding on our cache did.
    assert {r["page_size"] for r in data["correctness"] if r["kernel"] == "segment_attention_mass"} == {16, 64}
    rows = {(r["shape"], r["method"]): r for r in data["views"]}
    assert set(rows) == {("long_prompt", "gamma0"), ("long_prompt", "snapkv"), ("long_prompt", "attended"),
                         ("long_generation", "attended"), ("long_generation", "stock_static"),
                         ("long_generation", "gamma0_compiled")}
    assert all("error" not in r and r["identical_to_first"] for r in rows.values())
    assert {r["model"] for r in data["model"]} == {"llama-3.1-8b"}
    # The quantized draft (int8 on CPU) is timed beside the full-weight one, and the end-to-end
    # comparison with stock static-cache generate ran and decoded the same tokens (smoke shapes decode
    # 8 tokens in milliseconds: the times are noise there, only present).
    assert all(r["draft_weights"] == "int8" and r["td_quantized_over_tt"] for r in data["model"] if "graphs" in r
               and "error" not in r)
    e2e = data["end_to_end"]
    assert e2e["identical"] is True
    assert {"stock_static_decode_s", "magicdec_decode_s", "magicdec_acceptance"} <= set(e2e)
    md = (out / "gpu_check.md").read_text()
    assert "| Triton kernels match the fp32 twin (bf16, fp16) | yes |" in md and "## End to end" in md
    log = (out / "log.txt").read_text()
    assert "gpu_run: dry run on CPU" in log and "transformers" in log and "gpu_run: done in" in log


def test_model_measurements_past_the_time_budget_are_listed_as_skipped():
    """gpu_check starts no model measurement once its budget is spent; each is listed instead (the
    markdown's "Skipped (time budget)", test_report_renders_a_run_cut_short)."""
    check = _load("gpu_check")
    skipped = []
    units = [(32, 32768, False), (32, 32768, True)]
    rows = check.model_ratios("llama-3.1-8b", 1, units, None, None, 1, True, stock_shape=(32, 32768),
                              budget=check.Budget(0), skipped=skipped)
    assert rows == []
    assert skipped == [dict(model="llama-3.1-8b", batch=32, context=32768, graphs=False),
                       dict(model="llama-3.1-8b", batch=32, context=32768, graphs=True),
                       dict(model="llama-3.1-8b", path="stock_dynamic_cache_decode")]
