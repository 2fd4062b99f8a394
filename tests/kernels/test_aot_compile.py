"""Every Triton launch the dispatch makes for real model shapes compiles, ahead of time and on CPU,
for sm_80 (A100), sm_89 (L4 / L40S / RTX 40, the 99 KiB class) and sm_90 (H100): within each
device's shared memory, without register spills for fp16/bf16, and with 64-bit batch and head
offsets. The grid (tests/kernels/aot_compile.py): Llama-3.1-8B, Qwen2.5-7B (GQA 7), Gemma-2
(head_dim 256, soft-cap), gpt-oss (sinks, GQA 8, head_dim 64), head_dim 64/80/96; bf16 and fp32
on every device, fp16 on sm_89 (everywhere with HF_MAGICDEC_AOT_FULL=1); batch 1 and 32; verify
q = 1..9 on a 32K cache and draft views of budget 256/512/2048 plus scratch; the same verify calls
emitting the attention mass per page (pages of 16, 32 and 64: each partial-sum count the kernel
compiles, with the merge and the page-mass epilogue); SnapKV scoring with windows 16 and 32; and
one compile per kernel and switch combination with its float arguments typed fp64, as a compiled
step (``compile=``, inductor on CUDA) launches it.

The compiles run in a subprocess without Triton's interpreter (this session runs it), two at a
time, deduplicated by what Triton specialises on; Triton's own cache keeps them between runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aot_compile  # tests/kernels is on sys.path; importing the worker imports no Triton
import pytest

triton = pytest.importorskip("triton")

NVIDIA = Path(triton.__file__).parent / "backends" / "nvidia"


def _missing() -> str | None:
    for tool in ("ptxas", "cuobjdump"):
        if not (NVIDIA / "bin" / tool).exists():
            return f"the triton wheel has no {tool} (backends/nvidia/bin)"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as error:
        return f"this triton lacks an API the AOT compile uses: {error}"
    if not hasattr(JITFunction, "_pack_args"):
        return "this triton's JITFunction has no _pack_args (written against triton 3.9)"
    return None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    workers = str(min(2, os.cpu_count() or 1))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    full = ["--full"] if os.environ.get("HF_MAGICDEC_AOT_FULL", "0") not in ("", "0") else []
    done = subprocess.run([sys.executable, aot_compile.__file__, str(out), workers, *full], check=False,
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    print(f"\nAOT: {data['launches']} launches, {data['compiles']} distinct compiles, {data['seconds']} s")
    return data


def _each(report):
    for use in report["uses"]:
        yield use, report["results"].get(use["key"], {})


def _first(failures: list[str], limit: int = 20) -> str:
    return f"{len(failures)} launches, e.g.:\n" + "\n".join(failures[:limit])


def test_no_launch_is_refused_and_every_one_compiles(report):
    refused = [f"{u['device']} {u['label']}: {u['refused']}" for u in report["uses"] if u.get("refused")]
    assert not refused, _first(refused)
    failed = sorted({f"{u['device']} {u['kernel']} {u['config']}: {r['error']}" for u, r in _each(report)
                     if "error" in r})
    assert not failed, _first(failed, 5)


def test_shared_memory_fits_each_device_and_the_plans_estimate(report):
    over = [f"{u['device']} {u['label']} {u['kernel']} {u['config']}: {r['shared']} B > {u['limit']} B"
            for u, r in _each(report) if "shared" in r and r["shared"] > u["limit"]]
    assert not over, _first(over)
    # The plans pick tiles by an estimate; it must bound what the compiler allocates.
    under = sorted({f"{u['device']} {u['kernel']} {u['config']}: {r['shared']} B > estimate {u['estimate']} B"
                    for u, r in _each(report) if "shared" in r and u.get("estimate") and r["shared"] > u["estimate"]})
    assert not under, _first(under)


def test_no_register_spills_for_16_bit_inputs(report):
    spills = sorted({f"{u['device']} {u['kernel']} {u['dtype']} {u['config']}: {r['regs']} registers, "
                     f"{r['stack']} B stack, {r['local']} B local"
                     for u, r in _each(report) if u["dtype"] != "float32" and "regs" in r
                     and (r["stack"] or r["local"])})
    assert not spills, _first(spills)


def test_batch_and_head_offsets_are_64_bit(report):
    narrow = sorted({f"{u['device']} {u['kernel']}: {line}" for u, r in _each(report)
                     for line in r.get("narrow", ())})
    assert not narrow, _first(narrow)
    checked = {u["kernel"] for u, r in _each(report) if "narrow" in r}
    assert checked == set(aot_compile.WIDE_ARGS)


def test_fp16_compiles_like_bf16(report):
    """Where both were compiled (sm_89 by default, everywhere with HF_MAGICDEC_AOT_FULL=1), fp16
    and bf16 launches use the same shared memory, registers and stack: what lets the default run
    compile fp16 for one device only."""
    seen, compared = {}, 0
    for use, result in _each(report):
        if use["dtype"] in ("float16", "bfloat16") and "regs" in result:
            found = (result["shared"], result["regs"], result["stack"])
            seen.setdefault((use["device"], use["kernel"], repr(use["config"])), {})[use["dtype"]] = found
    for (device, kernel, config), by_dtype in seen.items():
        if len(by_dtype) == 2:
            compared += 1
            assert by_dtype["float16"] == by_dtype["bfloat16"], (device, kernel, config, by_dtype)
    assert compared >= 10


def test_every_kernel_compiles_as_a_compiled_step_launches_it(report):
    """``compile=`` (the default on CUDA) launches the kernels from an inductor graph, which types
    Python float arguments fp64 on CUDA. Kernels that let an fp64 ``scaling`` reach their running max
    failed to compile there (the first lent H200 run, 2026-12-04: every captured step and the
    end-to-end comparison raised InductorError); each kernel and switch combination compiles so typed."""
    compiled = report["inductor_floats"]
    assert {label.split()[0] for label in compiled} == set(aot_compile.WIDE_ARGS)
    failed = {label: result["error"][:500] for label, result in compiled.items() if "error" in result}
    assert not failed, failed


def test_narrow_offset_check_catches_32_bit_products():
    """The TTIR check itself: the old kernels' 32-bit ``b * stride_kb`` is reported, the new
    extension to i64 is not."""
    old = "%k_base = arith.muli %b, %stride_kb : i32 loc(#loc172)"
    new = "%k_base = arith.extsi %stride_kb : i32 to i64 loc(#loc198)\n%k = arith.muli %b_8, %k_base : i64"
    assert aot_compile.narrow_uses("tt.func @k(%stride_kb: i32) {\n" + old, ("stride_kb",)) == [old]
    assert aot_compile.narrow_uses("tt.func @k(%stride_kb: i32) {\n" + new, ("stride_kb",)) == []
