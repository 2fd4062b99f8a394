"""How the Triton kernels are launched: tile sizes, warps, pipeline stages and key-axis splits as
pure functions of shapes, dtypes and the device, and which calls they cannot serve.

Kept free of Triton so that the dispatcher (:mod:`hf_magicdec.kernels`) can decide before Triton is
imported, and so that ``tests/kernels/test_aot_compile.py`` compiles, for devices this machine does
not have, exactly the launches the real call would make.

Shared memory is what limits the tiles: Triton's software pipeline keeps ``num_stages`` copies of
every tile a loop loads, so a 256-wide fp32 head at the default 64 keys x 3 stages needs 283 KB,
more than any GPU has. Each plan takes the first tile/stage choice whose estimate fits the device's
opt-in shared memory per block (the estimates are upper bounds of what Triton 3.9 allocates; the AOT
test checks them against the compiler on sm_80, sm_89 and sm_90).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Largest packed query tile (g * q rows); the dispatcher uses the twin above it.
MAX_PACKED_ROWS = 128
# Widest head the kernels tile (the dot's K and N dimensions); wider heads use the twin.
MAX_HEAD_DIM = 256
# In-tile offsets (keys within one row and KV head, heads within one group) stay 32-bit; only the
# per-(row, head) base is 64-bit. A tensor whose tile would span 2^31 elements takes the twin.
INT32_SPAN = 2**31
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Narrowest page the segment-attention kernel sums its attention mass over (`mass_refusal`).
MIN_MASS_PAGE = 16


@dataclass(frozen=True)
class DeviceSpec:
    """What a launch configuration depends on.

    Attributes
    ----------
    name : for messages.
    capability : CUDA compute capability ``(major, minor)``.
    shared_memory : opt-in shared memory per block, bytes (the most one program may use).
    sms : streaming multiprocessors; 0 for Triton's interpreter (no occupancy to fill).
    """

    name: str
    capability: tuple[int, int]
    shared_memory: int
    sms: int


# Opt-in shared memory per block by compute capability (CUDA programming guide, "Technical
# Specifications per Compute Capability"), for torch builds whose device properties lack it.
SHARED_MEMORY_BY_CAPABILITY = {
    (7, 0): 98_304, (7, 5): 65_536,
    (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
    (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376,
}

#: The devices the AOT compile test targets (one per shared-memory class).
KNOWN_DEVICES = {
    "sm_80": DeviceSpec("A100 (sm_80)", (8, 0), 166_912, 108),
    "sm_89": DeviceSpec("L4 / L40S / RTX 40 (sm_89)", (8, 9), 101_376, 58),
    "sm_90": DeviceSpec("H100 (sm_90)", (9, 0), 232_448, 132),
}

# Triton's interpreter has no shared memory: it gets the tiles an H100 would, so the CPU tests run
# the same code paths.
INTERPRETER = DeviceSpec("Triton interpreter", (9, 0), 232_448, 0)


# Per CUDA device index, filled on first use. A plain dict rather than functools.cache: torch.compile
# traces through cached functions (it would trace the device query), but reads a filled dict as a
# constant; `hf_magicdec.kernels.check_backend` fills it eagerly, before any compiled step.
_CUDA_SPECS: dict[int, DeviceSpec] = {}


def device_spec(device: torch.device) -> DeviceSpec:
    """The :class:`DeviceSpec` of ``device`` (CUDA), or :data:`INTERPRETER` for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER
    index = device.index if device.index is not None else torch.cuda.current_device()
    spec = _CUDA_SPECS.get(index)
    if spec is None:
        spec = _CUDA_SPECS[index] = _query_cuda(index)
    return spec


def _query_cuda(index: int) -> DeviceSpec:
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or SHARED_MEMORY_BY_CAPABILITY.get(capability, 49_152)
    return DeviceSpec(props.name, capability, int(shared), props.multi_processor_count)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def packed_rows_tile(rows: int, block_d: int) -> int:
    """``BLOCK_M`` for ``g * q`` packed query rows: 16, 64 or 128 (few sizes, so that a changing γ
    compiles few variants; decode is bandwidth-bound, so padded rows cost little), every power of
    two for heads wider than 128, whose tiles are bound by shared memory."""
    if block_d > 128:
        return _pow2(rows)
    return 16 if rows <= 16 else 64 if rows <= 64 else 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- segment attention


@dataclass(frozen=True)
class SegmentPlan:
    """One segment-attention call: attention kernel grid ``(programs, splits)``, then, when
    ``splits > 1``, the merge kernel on ``(programs,)``."""

    block_m: int
    block_n: int
    block_d: int
    block_dv: int
    num_warps: int
    num_stages: int
    splits: int
    keys_per_split: int
    merge_m: int
    merge_warps: int


# Key-block width and pipeline depth, best first: 64 keys x 3 stages streams a head of 128 at full
# bandwidth; narrower or shallower only where that does not fit (or see `_max_keys`).
_SEGMENT_TILES = ((64, 3), (64, 2), (32, 3), (32, 2), (16, 2), (16, 1))


def _wgmma(elem: int, spec: DeviceSpec) -> bool:
    # Hopper's fp16/bf16 dots (wgmma) take an operand from shared memory; fp32 dots run on FMA units.
    return spec.capability >= (9, 0) and elem < 4


def segment_shared(block_m: int, block_n: int, block_d: int, block_dv: int, elem: int, stages: int,
                   spec: DeviceSpec) -> int:
    """Upper bound of the attention kernel's shared memory per program on ``spec``.

    The K and V tiles of ``stages - 1`` pipeline stages in flight (at least one), plus either the
    Q operand and the fp32 accumulator (sm_90, fp16/bf16) or the larger of the in-loop layout
    conversions (Q, P) and the epilogue's accumulator conversion. Fitted to Triton 3.9's
    allocations on sm_80/89/90; ``tests/kernels/test_aot_compile.py`` checks it bounds them."""
    stream = max(1, stages - 1) * block_n * (block_d + block_dv) * elem
    if _wgmma(elem, spec):
        scratch = block_m * block_d * elem + block_m * block_dv * 4
    else:
        scratch = max(block_m * (block_d + block_n) * elem, block_m * block_dv * 4)
    return stream + scratch + 1024


def _segment_warps(block_m: int, elem: int) -> int:
    # 8 warps once the fp32 accumulator, scores and Q fragments of 4 warps pass ~200 registers a
    # thread (64 packed rows in 16-bit, 32 in fp32), which spills.
    return 8 if block_m >= (64 if elem < 4 else 32) else 4


def _max_keys(block_d: int, block_dv: int, elem: int) -> int:
    """Widest key block tried: 64; 32 for heads wider than 128 (the same bytes per tile); 16 in
    fp32, whose IEEE dots run on FMA units (wider tiles spill and take seconds to compile)."""
    if elem == 4:
        return 16
    return 32 if max(block_d, block_dv) > 128 else 64


def _segment_tile(block_m: int, block_d: int, block_dv: int, elem: int, spec: DeviceSpec) -> tuple[int, int] | None:
    """``(BLOCK_N, num_stages)``: the first of :data:`_SEGMENT_TILES` that fits, or None."""
    most = _max_keys(block_d, block_dv, elem)
    for block_n, stages in _SEGMENT_TILES:
        if block_n <= most and segment_shared(block_m, block_n, block_d, block_dv, elem, stages,
                                              spec) <= spec.shared_memory:
            return block_n, stages
    return None


def default_splits(programs: int, kv_len: int, block_n: int, spec: DeviceSpec) -> int:
    """Key-axis splits so that ``programs * splits`` fills the GPU (about two waves), each split
    keeping at least four key blocks. A runtime argument of the kernels: any count, no recompile."""
    most = max(1, _cdiv(kv_len, 4 * block_n))
    if spec.sms:
        return max(1, min(most, _cdiv(2 * spec.sms, programs), 64))
    return min(most, 4)  # interpreter: exercise the merge on small shapes too


def plan_segment_attention(batch: int, kv_heads: int, group: int, q_len: int, head_dim: int, head_dv: int,
                           kv_len: int, dtype: torch.dtype, spec: DeviceSpec,
                           num_splits: int | None = None) -> SegmentPlan:
    """Launch configuration of ``segment_attention`` for ``[B, Hkv*g, q, D]`` queries over
    ``[B, Hkv, L, D|Dv]`` keys/values. Only for calls :func:`segment_attention_refusal` accepts.
    ``num_splits`` overrides the split count (tests)."""
    elem = torch.empty((), dtype=dtype).element_size()
    block_d, block_dv = _pow2(head_dim), _pow2(head_dv)
    block_m = packed_rows_tile(group * q_len, max(block_d, block_dv))
    block_n, stages = _segment_tile(block_m, block_d, block_dv, elem, spec)
    programs = batch * kv_heads
    splits = num_splits or default_splits(programs, kv_len, block_n, spec)
    keys_per_split = _cdiv(_cdiv(max(kv_len, 1), splits), block_n) * block_n
    splits = max(1, _cdiv(kv_len, keys_per_split))
    return SegmentPlan(block_m, block_n, block_d, block_dv, _segment_warps(block_m, elem), stages,
                       splits, keys_per_split, 16, 4)


def segment_attention_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              spec: DeviceSpec, page_size: int = 0) -> str | None:
    """Why the Triton kernel cannot serve this call on ``spec`` (the twin does), or None.

    ``query [B, H, q, D]``, ``key [B, Hkv, L, D]``, ``value [B, Hkv, L, Dv]``; ``page_size > 0``:
    the call also asks for the attention mass per page (:func:`mass_refusal`)."""
    if page_size and mass_refusal(page_size):
        return mass_refusal(page_size)
    group, q_len = query.shape[1] // key.shape[1], query.shape[2]
    if group * q_len > MAX_PACKED_ROWS:
        return f"packed query tile g*q = {group}*{q_len} > {MAX_PACKED_ROWS} rows"
    common = _common_refusal(query, (key, value), spec)
    if common:
        return common
    elem = query.element_size()
    block_d, block_dv = _pow2(query.shape[-1]), _pow2(value.shape[-1])
    block_m = packed_rows_tile(group * q_len, max(block_d, block_dv))
    if _segment_tile(block_m, block_d, block_dv, elem, spec) is None:
        return (f"no segment-attention tile for head_dim {query.shape[-1]} in {query.dtype} fits the "
                f"{spec.shared_memory} B of shared memory of {spec.name}")
    if page_size:
        # The mass partials of one program: at most one float per row per 16 keys of whole pages.
        runs = _cdiv(_cdiv(key.shape[2], page_size) * page_size, MIN_MASS_PAGE)
        if runs * group * q_len >= INT32_SPAN:
            return f"mass partials of {runs} x {group * q_len} floats per (row, KV head) span >= 2^31 elements"
    return _span_refusal(query, (key, value), group)


def mass_refusal(page_size: int) -> str | None:
    """Why the kernel cannot emit the attention mass per page of ``page_size`` keys, or None: it
    takes powers of two from :data:`MIN_MASS_PAGE` (key blocks are powers of two from 16, so a
    page then never straddles a block: a block holds whole pages, or a page whole blocks)."""
    if page_size < MIN_MASS_PAGE or page_size & (page_size - 1):
        return f"attention mass per page of {page_size} keys (the kernel takes powers of two >= {MIN_MASS_PAGE})"
    return None


def mass_units(page_size: int, block_n: int) -> int:
    """Partial sums the kernel writes per packed row and key block of ``block_n`` keys: one per page
    when pages are narrower than the block, else one (the epilogue adds up a page's blocks)."""
    return block_n // min(page_size, block_n)


def _common_refusal(query: torch.Tensor, others: tuple[torch.Tensor, ...], spec: DeviceSpec) -> str | None:
    if query.dtype not in DTYPES or any(t.dtype != query.dtype for t in others):
        return f"dtype {query.dtype} / {[str(t.dtype) for t in others]} (the kernels take fp16, bf16 or fp32)"
    if max(query.shape[-1], *(t.shape[-1] for t in others)) > MAX_HEAD_DIM:
        return f"head_dim {max(query.shape[-1], *(t.shape[-1] for t in others))} > {MAX_HEAD_DIM}"
    if query.dtype == torch.bfloat16 and spec.capability < (8, 0):
        return f"bf16 needs compute capability 8.0, {spec.name} has {spec.capability}"
    return None


def _span_refusal(query: torch.Tensor, kv: tuple[torch.Tensor, ...], group: int) -> str | None:
    """Refuse tensors whose 32-bit in-tile offsets could pass 2^31 elements: the ``group`` query
    heads of one KV head with their positions and dims; one KV head's keys and dims."""
    spans = [(query, (group - 1) * query.stride(1))] + [(t, 0) for t in kv]
    for tensor, head_span in spans:
        span = head_span + sum((n - 1) * s for n, s in zip(tensor.shape[2:], tensor.stride()[2:], strict=True))
        if span >= INT32_SPAN:
            return f"a {tuple(tensor.shape)} tensor with strides {tensor.stride()} spans >= 2^31 elements per head"
    return None


# --------------------------------------------------------------------------- SnapKV scoring


@dataclass(frozen=True)
class SnapKVPlan:
    """Both SnapKV passes: stats on ``(B*Hkv, cdiv(g*w, block_m))``, mass on ``(B*Hkv, cdiv(S, block_n))``."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    stats_stages: int
    mass_stages: int


# (rows, keys) per tile and pipeline depth, best first; fp32 (FMA dots) starts at 32 x 32
# (`_snapkv_tile`): larger fp32 tiles spill.
_SNAPKV_TILES = ((64, 64, 3), (64, 64, 2), (32, 64, 2), (32, 32, 2), (16, 32, 2), (16, 16, 1))


def snapkv_shared(block_m: int, block_n: int, block_d: int, elem: int, stages: int, spec: DeviceSpec) -> int:
    """Upper bound over both SnapKV passes' shared memory: the streamed operand (keys in pass 1,
    window queries in pass 2) for ``stages - 1`` stages in flight (at least one), plus the resident
    one (twice on sm_90 in fp16/bf16: the wgmma operand and its conversion). Checked like
    :func:`segment_shared`."""
    tiles = max(1, stages - 1) + (2 if _wgmma(elem, spec) else 1)
    return tiles * max(block_m, block_n) * block_d * elem + 1024


def _snapkv_tile(block_d: int, elem: int, spec: DeviceSpec) -> tuple[int, int, int] | None:
    for block_m, block_n, stages in _SNAPKV_TILES:
        if elem == 4 and block_m * block_n > 32 * 32:
            continue
        if snapkv_shared(block_m, block_n, block_d, elem, stages, spec) <= spec.shared_memory:
            return block_m, block_n, stages
    return None


def plan_snapkv(head_dim: int, dtype: torch.dtype, spec: DeviceSpec) -> SnapKVPlan:
    """Launch configuration of ``snapkv_mass`` (only for calls :func:`snapkv_refusal` accepts)."""
    elem = torch.empty((), dtype=dtype).element_size()
    block_d = _pow2(head_dim)
    block_m, block_n, stages = _snapkv_tile(block_d, elem, spec)
    # 8 warps: at 4, the 64 x 64 scores plus the resident operand spill on sm_89, and fp32 spills.
    return SnapKVPlan(block_m, block_n, block_d, 8, stages, stages)


def snapkv_refusal(queries: torch.Tensor, keys: torch.Tensor, spec: DeviceSpec) -> str | None:
    """Why the Triton SnapKV scoring cannot serve this call on ``spec``, or None.

    ``queries [B, H, w, D]``, ``keys [B, Hkv, S, D]``."""
    common = _common_refusal(queries, (keys,), spec)
    if common:
        return common
    if _snapkv_tile(_pow2(queries.shape[-1]), queries.element_size(), spec) is None:
        return (f"no SnapKV tile for head_dim {queries.shape[-1]} in {queries.dtype} fits the "
                f"{spec.shared_memory} B of shared memory of {spec.name}")
    return _span_refusal(queries, (keys,), queries.shape[1] // keys.shape[1])
