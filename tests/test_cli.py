"""The ``hf-magicdec`` entry point: one top-level ``--help`` listing every subcommand, ``--version``,
``--quiet`` accepted before or after any command. Fast: nothing here loads a model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hf_magicdec_bench import cli

EXPECTED = {"bench", "demo", "acceptance", "plan", "export-hub"}


def test_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-magicdec")
    assert EXPECTED <= set(cli.COMMANDS)
    for name, (module, text, _) in cli.COMMANDS.items():
        assert f"  {name} " in out and text in out
    assert "--version" in out and "--quiet" in out
    assert cli.main(["-h"]) == 0


def test_no_command_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    assert "usage: hf-magicdec" in capsys.readouterr().err


def test_version(capsys):
    import hf_magicdec

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hf-magicdec {hf_magicdec.__version__}"


def test_unknown_command_and_option(capsys):
    assert cli.main(["benchh"]) == 2
    assert "unknown command 'benchh'" in capsys.readouterr().err
    assert cli.main(["--loud", "bench"]) == 2
    assert "unknown option '--loud'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_command_answers_help_and_takes_quiet(name, capsys):
    """``<command> --help`` works through the entry point; ``--quiet`` before or after the command
    is accepted by every command (it is passed on, or applied by the entry point)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["--quiet", name, "--help"])
    assert exc.value.code == 0
    assert f"usage: hf-magicdec {name}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help", "-q"])
    assert exc.value.code == 0


def test_quiet_silences_progress(monkeypatch):
    for var in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(var, raising=False)
    calls = []
    monkeypatch.setitem(cli.COMMANDS, "probe", ("tests_cli_probe", "a probe", True))
    monkeypatch.setitem(sys.modules, "tests_cli_probe", type(sys)("tests_cli_probe"))
    sys.modules["tests_cli_probe"].main = lambda argv: calls.append(argv) or 0
    assert cli.main(["-q", "probe", "--x"]) == 0
    assert calls == [["--x", "--quiet"]]
    assert os.environ["TQDM_DISABLE"] == "1" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setitem(cli.COMMANDS, "probe", ("tests_cli_probe", "a probe", False))
    assert cli.main(["probe", "--quiet"]) == 0 and calls[-1] == []  # not passed to a command without it


def test_fresh_process_version_and_quiet_bars():
    """``python -m hf_magicdec_bench --version`` answers; in a fresh process (where the entry point runs
    before tqdm is imported) --quiet disables every tqdm bar, also those that do not ask."""
    proc = subprocess.run([sys.executable, "-m", "hf_magicdec_bench", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("hf-magicdec "), proc.stderr
    code = "from hf_magicdec_bench import cli; cli.quiet(); from tqdm.auto import tqdm; print(tqdm(total=1).disable)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr
