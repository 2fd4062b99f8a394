"""Compile, ahead of time and without a GPU, every Triton launch the dispatch makes for a grid of
real model shapes, for sm_80 / sm_89 / sm_90, and report what each device would face.

Run by ``test_aot_compile.py`` in a subprocess (``python tests/kernels/aot_compile.py OUT.json
[WORKERS] [--full]``): the test session runs Triton's interpreter, and an interpreted kernel cannot be
compiled, so this process imports Triton with ``TRITON_INTERPRET=0``. It imports only
``hf_magicdec.kernels``: describing a launch needs no engine, no transformers.

Each launch is built by the kernels' own ``*_launches`` functions (what the operators run) on
``meta`` tensors for each of :data:`hf_magicdec.kernels.launch.KNOWN_DEVICES`, bound by Triton's
own argument specialisation for that target (so the signature, constexprs and divisibility
attributes are those a real launch compiles), deduplicated by that compile key, and compiled to
cubin by the ``ptxas`` of the Triton wheel. Per compile: shared memory (``metadata.shared``),
registers, stack frame and local memory (spills) from ``cuobjdump -res-usage`` of the cubin, and
the uses of the batch/head strides in the TTIR that are not 64-bit.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Arguments whose every use must be 64-bit: batch and KV-head strides multiply program ids into
# offsets that pass 2^31 at real sizes (in-tile offsets such as head-in-group x stride_qh stay 32-bit).
WIDE_ARGS = {
    "_segment_attention_kernel": ("stride_qb", "stride_kb", "stride_kh", "stride_vb", "stride_vh", "stride_ob",
                                  "mass_blocks"),
    "_merge_splits_kernel": ("stride_ob",),
    "_page_mass_kernel": ("mass_blocks",),
    "_snapkv_stats_kernel": ("stride_qb", "stride_kb", "stride_kh"),
    "_snapkv_mass_kernel": ("stride_qb", "stride_kb", "stride_kh"),
}


@dataclass(frozen=True)
class Model:
    """The attention shape of a real model."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    softcap: float | None = None
    sinks: bool = False


MODELS = (
    Model("llama-3.1-8b", 32, 8, 128),
    Model("qwen2.5-7b", 28, 4, 128),  # GQA 7
    Model("gemma-2-9b", 16, 8, 256, softcap=50.0),
    Model("gpt-oss-20b", 64, 8, 64, sinks=True),
    Model("llama-3.2-1b", 32, 8, 64),
    Model("phi-2", 32, 32, 80),
    Model("phi-3-mini", 32, 32, 96),
)
DTYPES = ("float16", "bfloat16", "float32")
# fp16 and bf16 get the same tiles, and every compile of the full grid gave them the same shared
# memory, registers and stack: by default fp16 is compiled for the tightest device only (its 99 KiB),
# which halves the 16-bit compiles; ``--full`` (HF_MAGICDEC_AOT_FULL=1) compiles it everywhere.
FP16_DEVICES = ("sm_89",)
BATCHES = (1, 32)
VERIFY_Q = range(1, 10)  # gamma 0..8
CONTEXT = 32_768
DRAFT_BUDGETS = (256, 512, 2048)
# Verify launches that also emit the attention mass per page: one page size per partial-sum
# count the kernel compiles (`launch.mass_units`: 4, 2 or 1 per 64-key block; wider pages compile
# like 64, the block count being a runtime argument).
MASS_PAGES = (16, 32, 64)
SNAPKV_WINDOWS = (16, 32)
PROMPT = 8_192


def _import_kernels():
    """``hf_magicdec.kernels`` without running ``hf_magicdec/__init__`` (routing, engine, transformers)."""
    if "hf_magicdec" not in sys.modules:
        package = types.ModuleType("hf_magicdec")
        package.__path__ = [str(SRC / "hf_magicdec")]
        sys.modules["hf_magicdec"] = package
    from hf_magicdec.kernels import launch, triton_kernels

    return launch, triton_kernels


def segment_cases(torch, dtypes):
    """``(label, query, key, value, softcap, sinks)``: verify on the full cache and the draft on a
    compact view ``[budget | scratch q | trash 1]``, for every model, dtype, batch and q."""
    meta = torch.device("meta")
    for model in MODELS:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            sinks = torch.empty(model.heads, device=meta) if model.sinks else None
            for batch in BATCHES:
                for q_len in VERIFY_Q:
                    lengths = [("verify", CONTEXT + q_len)] + [(f"draft{n}", n + q_len + 1) for n in DRAFT_BUDGETS]
                    for kind, kv_len in lengths:
                        # Models hand queries over as a transposed [B, q, H, D] projection.
                        query = torch.empty(batch, q_len, model.heads, model.head_dim, dtype=dtype, device=meta)
                        key = torch.empty(batch, model.kv_heads, kv_len, model.head_dim, dtype=dtype, device=meta)
                        label = f"{model.name} {dtype_name} B{batch} q{q_len} {kind}"
                        yield label, query.transpose(1, 2), key, torch.empty_like(key), model.softcap, sinks


def snapkv_cases(torch, dtypes):
    """``(label, queries, keys)``: SnapKV scoring of an 8K prompt for every model, dtype, batch, window."""
    meta = torch.device("meta")
    for model in MODELS:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for batch in BATCHES:
                for window in SNAPKV_WINDOWS:
                    queries = torch.empty(batch, model.heads, window, model.head_dim, dtype=dtype, device=meta)
                    keys = torch.empty(batch, model.kv_heads, PROMPT, model.head_dim, dtype=dtype, device=meta)
                    yield f"{model.name} {dtype_name} B{batch} w{window} snapkv", queries, keys


def dtypes_for(device_name: str, full: bool) -> tuple[str, ...]:
    return DTYPES if full or device_name in FP16_DEVICES else tuple(d for d in DTYPES if d != "float16")


def launches(device_name: str, full: bool = True):
    """``(label, launch or None, refusal reason or None)`` for every call of the grid on ``device_name``."""
    import torch

    launch, tk = _import_kernels()
    spec = launch.KNOWN_DEVICES[device_name]
    dtypes = dtypes_for(device_name, full)
    rows = torch.empty(max(BATCHES), dtype=torch.int32, device="meta")
    for label, query, key, value, softcap, sinks in segment_cases(torch, dtypes):
        reason = launch.segment_attention_refusal(query, key, value, spec)
        if reason:
            yield label, None, reason
            continue
        seg = rows[: query.shape[0]]
        _, _, made = tk.segment_attention_launches(query, key, value, seg, seg, seg, seg, 0.1, softcap, sinks, 0,
                                                   spec)
        yield from ((label, one, None) for one in made)
        if label.endswith("verify"):
            yield from mass_launches(label, query, key, value, softcap, sinks, seg, made[0].kwargs["BLOCK_N"], spec)
    for label, queries, keys in snapkv_cases(torch, dtypes):
        reason = launch.snapkv_refusal(queries, keys, spec)
        if reason:
            yield label, None, reason
            continue
        _, made = tk.snapkv_launches(queries, keys, rows[: queries.shape[0]], 0.1, spec)
        yield from ((label, one, None) for one in made)


def mass_launches(label, query, key, value, softcap, sinks, seg, block_n: int, spec):
    """The same verify call emitting the attention mass, for each page size of :data:`MASS_PAGES`
    that gives a distinct partial-sum count on this plan (the others compile alike)."""
    launch, tk = _import_kernels()
    units = set()
    for page in MASS_PAGES:
        reason = launch.segment_attention_refusal(query, key, value, spec, page)
        if reason:
            yield f"{label} mass{page}", None, reason
            continue
        if launch.mass_units(page, block_n) in units:
            continue
        units.add(launch.mass_units(page, block_n))
        _, _, made = tk.segment_attention_launches(query, key, value, seg, seg, seg, seg, 0.1, softcap, sinks, 0,
                                                   spec, page_size=page)
        yield from ((f"{label} mass{page}", one, None) for one in made)


def estimate(launch_, spec) -> int | None:
    """The plan's shared-memory bound for this launch (what chose its tiles), if it has one."""
    launch, _ = _import_kernels()
    kw, name = launch_.kwargs, launch_.kernel.fn.__name__
    elem = launch_.args[0].element_size()
    if name == "_segment_attention_kernel":
        return launch.segment_shared(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_D"], kw["BLOCK_DV"], elem,
                                     kw["num_stages"], spec)
    if name.startswith("_snapkv"):
        return launch.snapkv_shared(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_D"], elem, kw["num_stages"], spec)
    return None


def _cheap_key(launch_, capability: int) -> tuple:
    """A key at least as fine as Triton's specialisation (tensor dtypes, meta tensors being all
    aligned; each integer's divisibility by 16, equality to 1 and width), to bind each once."""
    def feature(arg):
        if hasattr(arg, "dtype"):
            return str(arg.dtype)
        if isinstance(arg, bool) or not isinstance(arg, int):
            return type(arg).__name__
        return (arg == 1, arg % 16 == 0, arg >= 2**31)

    return (launch_.kernel.fn.__name__, capability, tuple(map(feature, launch_.args)),
            tuple(sorted(launch_.kwargs.items())))


def bind(launch_, capability: int):
    """What Triton would compile for this launch on ``capability``: (key, source, options)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch_.kernel
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch_.kwargs, "debug": False}
    bound, specialization, options = binder(*launch_.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    key = repr((fn.__name__, capability, sorted(signature.items()), sorted(constexprs.items()),
                sorted((k, repr(v)) for k, v in attrs.items()), sorted(options.__dict__.items())))
    return key, (fn.__name__, signature, constexprs, attrs), options.__dict__


def narrow_uses(ttir: str, names) -> list[str]:
    """TTIR lines that use one of the arguments ``names`` in 32-bit arithmetic (a use must be a
    sign extension to i64 or an i64 operation)."""
    uses = re.compile(r"%(" + "|".join(map(re.escape, names)) + r")\b")
    body = ttir.split("tt.func", 1)[-1].split("\n", 1)[-1]  # skip the signature
    return [line.strip() for line in body.splitlines() if uses.search(line) and "i64" not in line]


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def compile_one(job) -> dict:
    """Compile one bound launch to cubin: its resources and narrow offsets, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, tk = _import_kernels()
    capability, (name, signature, constexprs, attrs), options = job
    started = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(getattr(tk, name), signature, constexprs, attrs),
                                target=GPUTarget("cuda", capability, 32), options=options)
    except Exception as error:  # noqa: BLE001  (any compiler failure is a finding, reported per launch)
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    regs, stack, local = _resources(kernel.asm["cubin"])
    return {"shared": kernel.metadata.shared, "regs": regs, "stack": stack, "local": local,
            "narrow": narrow_uses(kernel.asm["ttir"], WIDE_ARGS[name]),
            "seconds": round(time.perf_counter() - started, 2)}


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """Registers, stack frame and local memory per thread (ptxas puts spills in the stack frame)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        out = subprocess.run([str(nvidia_bin() / "cuobjdump"), "-res-usage", handle.name], capture_output=True,
                             text=True, check=True)
    regs, stack, local = map(int, _RESOURCES.search(out.stdout).groups())
    return regs, stack, local


def nvidia_bin() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _cost(job) -> tuple:
    # Longest first (attention kernels, fp32 ones first: their dots are unrolled FMAs), so that the
    # workers finish together.
    _, (name, signature, _, _), _ = job
    return name != "_segment_attention_kernel", signature.get("K") != "*fp32"


def run(workers: int, full: bool) -> dict:
    """Bind every launch for every device, compile the distinct ones, and map results back."""
    launch, _ = _import_kernels()
    started = time.perf_counter()
    jobs, uses, bound = {}, [], {}
    for device_name, spec in launch.KNOWN_DEVICES.items():
        capability = spec.capability[0] * 10 + spec.capability[1]
        for label, one, refused in launches(device_name, full):
            use = {"device": device_name, "limit": spec.shared_memory, "label": label,
                   "dtype": label.split()[1], "refused": refused}
            uses.append(use)
            if one is None:
                continue
            cheap = _cheap_key(one, capability)  # binding is slow: launches alike bind once
            if cheap not in bound:
                bound[cheap] = bind(one, capability)
            key, source, options = bound[cheap]
            jobs.setdefault(key, (capability, source, options))
            use.update(key=key, kernel=source[0], estimate=estimate(one, spec),
                       config={k: v for k, v in one.kwargs.items() if k.isupper() or k.startswith("num_")})
    bind_seconds = time.perf_counter() - started
    keys = sorted(jobs, key=lambda k: _cost(jobs[k]))
    variants = inductor_samples(jobs)
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = dict(zip(keys, pool.map(compile_one, [jobs[k] for k in keys], chunksize=1), strict=True))
            inductor = dict(zip(variants, pool.map(compile_one, [inductor_variant(jobs[k]) for k in variants.values()],
                                                   chunksize=1), strict=True))
    else:
        results = {k: compile_one(jobs[k]) for k in keys}
        inductor = {label: compile_one(inductor_variant(jobs[k])) for label, k in variants.items()}
    return {"launches": len(uses), "compiles": len(keys), "full": full, "bind_seconds": round(bind_seconds, 1),
            "seconds": round(time.perf_counter() - started, 1), "results": results, "uses": uses,
            "inductor_floats": inductor}


def inductor_variant(job):
    """The same compile with every float scalar (``scaling``, ``softcap``) typed fp64: what
    ``torch.compile`` passes when a compiled step launches the kernels through their operators on
    CUDA (inductor types Python floats fp64 there: ``torch/_inductor/codegen/triton_utils.py``)."""
    capability, (name, signature, constexprs, attrs), options = job
    wide = {arg: "fp64" if kind == "fp32" else kind for arg, kind in signature.items()}
    return capability, (name, wide, constexprs, attrs), options


def inductor_samples(jobs: dict) -> dict:
    """One sm_90 compile per kernel and combination of its boolean switches (mass, soft-cap, fp32
    upcast, ...), by label: the launches to compile again as inductor types them."""
    _, tk = _import_kernels()
    samples = {}
    for key, (capability, (name, signature, constexprs, _), _) in sorted(jobs.items()):
        if capability != 90:
            continue
        names = getattr(tk, name).arg_names  # constexprs are keyed by (index,)
        flags = ",".join(f"{names[k[0]] if isinstance(k, tuple) else k}={v}" for k, v in sorted(constexprs.items())
                         if isinstance(v, bool))
        samples.setdefault(f"{name} {flags}", key)
    return samples


def main(argv: list[str]) -> int:
    full = "--full" in argv
    args = [a for a in argv[1:] if a != "--full"]
    workers = int(args[1]) if len(args) > 1 else 1
    Path(args[0]).write_text(json.dumps(run(workers, full)))
    return 0


if __name__ == "__main__":
    # Before Triton is imported: compile for real targets instead of interpreting.
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    sys.exit(main(sys.argv))
