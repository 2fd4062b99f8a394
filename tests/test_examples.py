"""The examples, the notebooks and the docs run, and say true things.

* Every script in ``examples/`` runs on the real small model (SmolLM2-135M-Instruct, offline) with
  small settings (``multi_gpu.py``: its ``--tiny`` model), as a subprocess, and reports what it
  checks (``publish_to_hub.py`` runs in ``tests/test_model_card.py``). Scripts this file does not
  know yet must at least answer ``--help``.
* The notebooks are committed without outputs and execute through nbclient (ipykernel), with their
  ``parameters`` cell replaced by small values.
* The README's quickstart executes (with smaller sizes), the README keeps exactly one demo and one
  test command, and the docs name only things that exist.
* The docs site builds with ``mkdocs build --strict`` and its API reference covers ``__all__``.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: Pages other work streams own; the site links them (see ``test_docs_build_strict``).
#: Pages whose every ``hf_magicdec.<name>`` must resolve.
CHECKED_PAGES = [README] + [DOCS / f"{n}.md" for n in (
    "index", "design", "configuration", "api", "faq", "model_card", "changelog", "benchmarks", "cost_model")]

SMALL = ["--batch", "2", "--context", "256", "--new-tokens", "16"]
#: script -> (arguments, lines its output must contain)
SCRIPTS = {
    "quickstart.py": (SMALL + ["--budget", "64"], ["identical to stock generate: yes", "acceptance rate"]),
    "long_context_batch.py": (["--batch", "3", "--context", "384", "--new-tokens", "16", "--budget", "96"],
                              ["identical to stock generate: yes", "batch: acceptance", "prompts of 256..384 tokens"]),
    "sampling.py": (SMALL + ["--budget", "64"], ["identical draws", "3. the same seed again: identical"]),
    "plan_then_generate.py": (["--batch", "2", "--context", "320", "--new-tokens", "12", "--force",
                               "--hardware", "h100"],
                              ["--- plan on h100", "--- plan on this device", "identical to stock generate: yes"]),
    "reuse_prefix.py": (["--context", "256", "--new-tokens", "12", "--budget", "64"],
                        ["all answers identical to stock generate: yes", "prefill saved"]),
    # docs/multi_gpu.md's script; --tiny: a random tiny Llama behind a device map, runs on one CPU.
    "multi_gpu.py": (["--tiny"], ["identical to stock generate: yes"]),
    # docs/trl.md's script: one GRPO step whose rollouts go through MagicDec, checked against stock.
    "grpo_rollouts.py": (["--prompts", "2", "--generations", "2", "--new-tokens", "16", "--passage-words", "80",
                          "--greedy", "--check"], ["rollouts identical to stock generate: yes", "model in training mode"]),
}
#: Scripts that need an optional dependency (skipped without it).
REQUIRES = {"grpo_rollouts.py": "trl"}
COVERED_ELSEWHERE = {"publish_to_hub.py"}  # tests/test_model_card.py


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------- scripts
@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_script_runs(script):
    if script in REQUIRES:
        pytest.importorskip(REQUIRES[script])
    args, expected = SCRIPTS[script]
    proc = _run([str(EXAMPLES / script), *args])
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    for line in expected:
        assert line in proc.stdout, f"{script}: {line!r} missing from\n{proc.stdout}"


def test_new_example_scripts_answer_help():
    """A script added to examples/ without a line in SCRIPTS is at least importable and documented."""
    for script in sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in set(SCRIPTS) | COVERED_ELSEWHERE):
        proc = _run([str(EXAMPLES / script), "--help"], timeout=120)
        assert proc.returncode == 0, f"{script} --help failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"


def test_every_example_is_documented():
    listed = (DOCS / "index.md").read_text(encoding="utf-8")
    for path in sorted(EXAMPLES.glob("*.py")) + sorted(NOTEBOOKS.glob("*.ipynb")):
        assert path.name in listed, f"{path.name} is not listed in docs/index.md"


# ---------------------------------------------------------------- notebooks
NOTEBOOK_PARAMETERS = {
    "quickstart.ipynb": 'MODEL = "smollm2-135m"\nBATCH = 2\nCONTEXT = 256\nNEW_TOKENS = 12\n'
                        'DRAFT, BUDGET, GAMMA = "snapkv", 64, 3',
    "benchmark.ipynb": 'MODEL = "smollm2-135m"\nBATCH = 2\nCONTEXTS = (256, 320)\nNEW_TOKENS = 8\n'
                       'DRAFTS = ("streamingllm", "snapkv")\nBUDGETS = (64,)\nGAMMAS = (3,)\n'
                       'STATIC_BASELINE = False\nWARMUP = False',
}


def test_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(NOTEBOOK_PARAMETERS), found
    for name in found:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs not stripped"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: needs exactly one cell tagged 'parameters'"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NOTEBOOK_PARAMETERS))
def test_notebook_executes(name, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    # Every name the committed cell defines is overridden: the small run exercises the same code.
    defined = set(re.findall(r"^(\w+(?:, \w+)*) =", cell.source, re.M))
    assert defined == set(re.findall(r"^(\w+(?:, \w+)*) =", NOTEBOOK_PARAMETERS[name], re.M))
    cell.source = NOTEBOOK_PARAMETERS[name]
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError with the traceback on failure
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if name == "quickstart.ipynb":
        assert "identical to stock generate: yes" in text
    else:
        assert "magicdec snapkv/64" in text and images >= 3, (text, images)


# ---------------------------------------------------------------- README
def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_keeps_one_demo_and_one_test_command():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"## The two commands\n+```bash\n(.*?)```", text, re.S)
    assert block, "README lost its 'The two commands' block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"], commands
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.slow
def test_readme_quickstart_runs():
    text = README.read_text(encoding="utf-8")
    quick = text[text.index("## Quickstart"):]
    code = _python_blocks(quick)[0]
    assert len(code.strip().splitlines()) <= 12, "the quickstart should stay about ten lines"
    # The same code at a size that runs in seconds.
    for old, new in (("prompt_batch(tok, 8, 256)", "prompt_batch(tok, 2, 256)"),
                     ("max_new_tokens=2048", "max_new_tokens=8")):
        assert old in code, f"README quickstart changed: {old!r} not found; update this test"
        code = code.replace(old, new)
    proc = _run(["-c", code])
    assert proc.returncode == 0, f"README quickstart failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    # summary(): of the speculation, or, at this small size on a CPU without a calibration, of the
    # planner declining it (the README's own shape speculates).
    out = proc.stdout
    assert ("steps of the batch" in out and "per row-step: acceptance" in out) or \
        "plain decoding with stock generate (the planner's choice" in out, out


# ---------------------------------------------------------------- docs say true things
def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_docs_name_only_existing_things():
    from hf_magicdec_bench.cli import COMMANDS

    names, commands = set(), set()
    for page in CHECKED_PAGES:
        text = page.read_text(encoding="utf-8")
        names |= {n.rstrip(".") for n in re.findall(r"\bhf_magicdec(?:_bench)?(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text)}
        commands |= set(re.findall(r"(?:^|`)hf-magicdec ([a-z][a-z-]*)\b", text, re.M))  # commands, not prose
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"docs name things that do not exist: {missing}"
    assert commands <= set(COMMANDS), f"unknown CLI commands in docs: {sorted(commands - set(COMMANDS))}"


def test_option_tables_list_real_fields():
    import dataclasses

    from hf_magicdec import MagicDecConfig

    fields = {f.name for f in dataclasses.fields(MagicDecConfig)}
    lines = (DOCS / "configuration.md").read_text(encoding="utf-8").split("## The fields", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = "\n".join(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    listed = set(re.findall(r"^\| `(\w+)`", table, re.M))
    assert listed and listed <= fields, sorted(listed - fields)


def test_api_reference_covers_every_public_name():
    import hf_magicdec

    api = (DOCS / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: hf_magicdec\.(\w+)$", api, re.M))
    assert set(hf_magicdec.__all__) <= documented, sorted(set(hf_magicdec.__all__) - documented)


def test_docs_build_strict(tmp_path):
    """``mkdocs build --strict``: broken links, missing pages and docstring errors fail it."""
    pytest.importorskip("mkdocs", reason="install the test extra: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="hf_magicdec.MagicDecConfig"' in api and 'id="hf_magicdec.generate"' in api
