"""The package's layering holds: import-linter contracts (``.importlinter``) and a library that
imports and generates with the tooling package made unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_kept():
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(ROOT / ".importlinter")) == 0, "an import contract is broken (see above)"


def test_library_works_without_the_tooling():
    """``hf_magicdec`` imports and generates with ``hf_magicdec_bench`` blocked."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["hf_magicdec_bench"] = None  # any import of the tooling now raises ImportError
        import torch
        import hf_magicdec
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1)).eval()
        ids = torch.randint(3, 64, (2, 12))
        kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        out = model.generate(**kwargs, speculative="magicdec", draft="streamingllm", draft_budget=8,
                             sink_tokens=2, gamma=2)
        assert torch.equal(out, model.generate(**kwargs))
        plan = hf_magicdec.plan(model, batch_size=2, prompt_len=12, new_tokens=6)
        assert not any(name.startswith("hf_magicdec_bench") for name in sys.modules if sys.modules[name])
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


#: The library's only function-local imports, each of a dependency that is optional where it is used:
#: Triton (GPU kernels), torch inside the torch-free planner (naming a device for a calibration), and
#: transformers' DeepSpeed / FSDP helpers, whose home moved between releases, and torchao (quantized
#: draft weights on CUDA).
OPTIONAL_LOCAL_IMPORTS = {
    ("hf_magicdec/engine/draft_weights.py", "torchao.quantization"),
    ("hf_magicdec/kernels/__init__.py", "hf_magicdec.kernels.triton_kernels"),
    ("hf_magicdec/planner/calibration_store.py", "torch"),
    ("hf_magicdec/parallel/lockstep.py", "transformers.integrations.deepspeed"),
    ("hf_magicdec/parallel/lockstep.py", "transformers.distributed.fsdp"),
    ("hf_magicdec/parallel/lockstep.py", "transformers.integrations.fsdp"),
}


def _local_imports(path: Path, package: str):
    """``(module imported)`` for every import inside a function body of ``path``."""
    import ast

    tree = ast.parse(path.read_text())
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
                if node.level and not node.module:
                    yield from (f"{base}.{alias.name}" for alias in node.names)
                else:
                    yield module


def test_function_local_imports_only_for_optional_dependencies():
    """Imports at module top show the dependencies; a function-local import would hide a cycle."""
    src = ROOT / "src"
    found = set()
    for path in (src / "hf_magicdec").rglob("*.py"):
        rel = path.relative_to(src)
        package = ".".join(rel.with_suffix("").parts[:-1]) if rel.name != "__init__.py" else ".".join(rel.parts[:-1])
        found |= {(rel.as_posix(), module) for module in _local_imports(path, package)}
    assert found == OPTIONAL_LOCAL_IMPORTS, sorted(found ^ OPTIONAL_LOCAL_IMPORTS)
