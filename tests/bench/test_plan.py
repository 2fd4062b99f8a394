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
