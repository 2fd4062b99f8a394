"""The package's layering holds: import-linter contracts (``.importlinter``) and a library that
imports and generates with the tooling package made unimportable."""

from __future__ import annotations

import re
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
#: Triton (GPU kernels), transformers' DeepSpeed / FSDP helpers, whose home moved between releases, and
#: torchao (quantized draft weights on CUDA).
OPTIONAL_LOCAL_IMPORTS = {
    ("hf_magicdec/engine/draft_weights.py", "torchao.quantization"),
    ("hf_magicdec/kernels/__init__.py", "hf_magicdec.kernels.triton_kernels"),
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


# ---------------------------------------------------------------------------------- the cache owns its state
#: Writes outside ``engine/cache/`` to objects that have cache-like attribute names but are not ours:
#: the user's transformers cache, moved into ours and handed back (``engine/continuation.py``).
FOREIGN_CACHE_WRITES = {("hf_magicdec/engine/continuation.py", "adopt"),
                        ("hf_magicdec/engine/continuation.py", "hand_back")}


#: Names of the expressions a cache's objects are reached through (``cache``, ``layer``, ``cache.layers[i]``,
#: ``geometry``, ``forward``, ``layer.draft`` …).
CACHE_LIKE = re.compile(r"cache|layer|geometry|forward|draft", re.IGNORECASE)


def _cache_state_names() -> set[str]:
    """Attribute names the cache package's objects hold: what its classes assign on ``self``, and the
    fields of its dataclasses."""
    import ast
    import dataclasses

    from hf_magicdec.engine import cache as package

    names = {"keys", "values", "is_initialized", "device", "dtype"}  # transformers' layer attributes
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    names |= {f.name for cls in (package.DraftGeometry, package.CacheOptions) for f in dataclasses.fields(cls)}
    return names


def _writes(tree, names: set[str]):
    """``(function, line, attribute)`` of every assignment to ``x.<name>``, subscript assignment into
    ``x.<name>[...]`` and in-place method call ``x.<name>.op_(...)`` (``x`` not ``self``)."""
    import ast

    def receiver(node) -> str:
        while isinstance(node, (ast.Subscript, ast.Call)):
            node = node.value if isinstance(node, ast.Subscript) else node.func
        return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")

    def owner(attr: ast.Attribute) -> bool:
        name = receiver(attr.value)
        return attr.attr in names and name != "self" and CACHE_LIKE.search(name) is not None

    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(func):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for part in ast.walk(t):
                    if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store) and owner(part):
                        yield func.name, node.lineno, part.attr
                    if isinstance(part, ast.Subscript) and isinstance(part.value, ast.Attribute) and owner(part.value):
                        yield func.name, node.lineno, part.value.attr
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_") \
                    and not node.func.attr.startswith("_") and isinstance(node.func.value, ast.Attribute) \
                    and owner(node.func.value):
                yield func.name, node.lineno, node.func.value.attr


def test_only_the_cache_writes_its_state():
    """No module outside ``engine/cache/`` assigns, indexes into or updates in place an attribute the
    cache's objects hold (read from the source, scripts included): they go through its methods."""
    import ast

    names = _cache_state_names()
    src = ROOT / "src"
    found = []
    for path in [*(src / "hf_magicdec").rglob("*.py"), *(src / "hf_magicdec_bench").rglob("*.py"),
                 *(ROOT / "scripts").glob("*.py")]:
        rel = path.relative_to(src if src in path.parents else ROOT).as_posix()
        if rel.startswith("hf_magicdec/engine/cache/"):
            continue
        for func, line, attr in _writes(ast.parse(path.read_text()), names):
            if (rel, func) not in FOREIGN_CACHE_WRITES:
                found.append(f"{rel}:{line} {func}() writes .{attr}")
    assert not found, "\n".join(found)


#: Lines of code a library function may have, its docstring not counted: one screen.
MAX_FUNCTION_LINES = 60


def test_library_functions_fit_on_a_screen():
    import ast

    long = []
    for path in (ROOT / "src" / "hf_magicdec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                doc = node.body[0]
                if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                    lines -= doc.end_lineno - doc.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)
