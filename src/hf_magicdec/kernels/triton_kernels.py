"""Triton kernels: ragged segment attention (verify and draft) and fused SnapKV scoring.

Imported only when the Triton backend is chosen (:mod:`hf_magicdec.kernels`), so CPU-only
installs never need Triton. Every kernel accumulates in fp32 whatever the input dtype, and has a
twin with the same signature in :mod:`hf_magicdec.kernels.reference`.

Segment attention (flash-decoding layout):

* one program per (row, KV head, split of the key axis); the ``g`` query heads that share a KV
  head and the ``q`` query positions are packed into one ``[g*q, D]`` tile, so each KV byte is
  read once per step whatever the GQA ratio and the number of verified tokens;
* the key axis is split so that few long rows still fill the GPU; each split keeps an online
  softmax (max, sum, unnormalised output) and a second kernel merges the splits;
* splits outside a row's key ranges do no work, so ragged rows cost their own length.

SnapKV scoring runs in two passes over the prompt keys (softmax statistics per window query,
then the probability mass per key summed over the window and the query heads of each KV head),
so it never holds the ``[B, H, w, S]`` attention matrix.

Both entry points are registered as PyTorch custom operators with ``torch.library.triton_op``
(``torch.ops.hf_magicdec.segment_attention`` / ``snapkv_mass``), their kernels launched through
``wrap_triton``, with explicit fake implementations (output shapes): ``torch.compile`` traces
them as single operators without a graph break, so a compiled draft or verify step keeps the
Triton attention (and CUDA graphs capture its launches).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) computes bf16 `tl.dot` wrongly (3.9):
# there, half-precision tiles are multiplied in fp32; on GPUs they go to the tensor cores.
_UPCAST_DOTS = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Largest packed query tile (g * q rows); the dispatcher uses the twin above it.
MAX_PACKED_ROWS = 128


@triton.jit
def _segment_attention_kernel(
    Q, K, V, Out, PartO, PartM, PartL, Sinks,
    Lo1, Hi1, Lo2, Hi2,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ob, stride_oq, stride_oh, stride_od,
    kv_heads, kv_len, keys_per_split, scaling, softcap,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads
    # Packed row r serves query head kvh*GROUP + r // Q_LEN at query position r % Q_LEN.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Q_LEN
    head = kvh * GROUP + rows // Q_LEN
    qi = rows % Q_LEN
    shift = Q_LEN - 1 - qi
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + qi[:, None] * stride_qq + d[None, :] * stride_qd,
        mask=row_ok[:, None] & (d[None, :] < HEAD_D), other=0.0,
    )
    lo1 = tl.load(Lo1 + b)
    hi1 = tl.load(Hi1 + b)
    lo2 = tl.load(Lo2 + b)
    hi2 = tl.load(Hi2 + b)
    # Only the envelope of the two ranges is read: a ragged row costs its own length.
    env_lo = tl.minimum(tl.where(hi1 > lo1, lo1, kv_len), tl.where(hi2 > lo2, lo2, kv_len))
    env_hi = tl.maximum(tl.where(hi1 > lo1, hi1, 0), tl.where(hi2 > lo2, hi2, 0))
    start = tl.maximum(pid_s * keys_per_split, env_lo)
    stop = tl.minimum(tl.minimum((pid_s + 1) * keys_per_split, kv_len), env_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < stop
        k = tl.load(
            k_base + cols[None, :] * stride_kl + d[:, None] * stride_kd,
            mask=col_ok[None, :] & (d[:, None] < HEAD_D), other=0.0,
        )
        if UPCAST:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        elif IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scaling
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        in1 = (cols >= lo1) & (cols < hi1)
        in2 = (cols[None, :] >= lo2) & (cols[None, :] < hi2 - shift[:, None])
        valid = (in1[None, :] | in2) & col_ok[None, :] & row_ok[:, None]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vl + dv[None, :] * stride_vd,
            mask=col_ok[:, None] & (dv[None, :] < HEAD_DV), other=0.0,
        )
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        if HAS_SINKS:
            m_i, l_i, acc = _add_sink(Sinks, head, row_ok, m_i, l_i, acc)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            Out + b * stride_ob + qi[:, None] * stride_oq + head[:, None] * stride_oh + dv[None, :] * stride_od,
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & (dv[None, :] < HEAD_DV),
        )
    else:
        part = pid_bh * NUM_SPLITS + pid_s
        tl.store(PartO + (part * BLOCK_M + rows[:, None]) * BLOCK_DV + dv[None, :], acc)
        tl.store(PartM + part * BLOCK_M + rows, m_i)
        tl.store(PartL + part * BLOCK_M + rows, l_i)


@triton.jit
def _tanh(x):
    # tanh from exp (portable across backends and the interpreter); exp(-2|x|) never overflows.
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _add_sink(Sinks, head, row_ok, m_i, l_i, acc):
    """Fold one sink logit per query head into an online softmax state: it joins the
    denominator and contributes no value (gpt-oss ``s_aux``)."""
    sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32)
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    l_new = l_i * alpha + tl.exp(sink - m_safe)
    return m_new, l_new, acc * alpha[:, None]


@triton.jit
def _merge_splits_kernel(
    PartO, PartM, PartL, Out, Sinks,
    stride_ob, stride_oq, stride_oh, stride_od,
    kv_heads,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads
    rows = tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    base = pid_bh * NUM_SPLITS
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(PartM + (base + i) * BLOCK_M + rows))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for i in range(NUM_SPLITS):
        w = tl.exp(tl.load(PartM + (base + i) * BLOCK_M + rows) - m_safe)
        denom += w * tl.load(PartL + (base + i) * BLOCK_M + rows)
        acc += w[:, None] * tl.load(PartO + ((base + i) * BLOCK_M + rows[:, None]) * BLOCK_DV + dv[None, :])
    row_ok = rows < GROUP * Q_LEN
    head = kvh * GROUP + rows // Q_LEN
    qi = rows % Q_LEN
    if HAS_SINKS:
        m_max, denom, acc = _add_sink(Sinks, head, row_ok, m_safe, denom, acc)
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(
        Out + b * stride_ob + qi[:, None] * stride_oq + head[:, None] * stride_oh + dv[None, :] * stride_od,
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < HEAD_DV),
    )


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def default_splits(programs: int, kv_len: int, block_n: int, device: torch.device) -> int:
    """Key-axis splits so that ``programs * splits`` fills the GPU (about two waves), each split
    keeping at least four key blocks."""
    most = max(1, triton.cdiv(kv_len, 4 * block_n))
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(most, triton.cdiv(2 * sms, programs), 64))
    return min(most, 4)  # interpreter: exercise the merge on small shapes too


def segment_attention(query, key, value, segments, scaling: float, softcap: float | None = None,
                      sinks: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Triton twin of :func:`hf_magicdec.kernels.reference.segment_attention` (same contract,
    soft-capping and sinks included), through the ``hf_magicdec::segment_attention`` operator.

    ``num_splits`` overrides the key-axis split count (tests use it to hit both code paths).
    """
    seg = segments.to(query.device)
    return torch.ops.hf_magicdec.segment_attention(query, key, value, seg.lo1, seg.hi1, seg.lo2, seg.hi2,
                                                   float(scaling), softcap, sinks, num_splits or 0)


@triton_op("hf_magicdec::segment_attention", mutates_args={})
def _segment_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo1: torch.Tensor,
                          hi1: torch.Tensor, lo2: torch.Tensor, hi2: torch.Tensor, scaling: float,
                          softcap: float | None, sinks: torch.Tensor | None, num_splits: int) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len, head_dv = key.shape[1], key.shape[2], value.shape[-1]
    group = heads // kv_heads
    out = torch.empty((batch, q_len, heads, head_dv), dtype=query.dtype, device=query.device)
    block_m, block_n = _pow2(group * q_len), 64
    block_d, block_dv = _pow2(head_dim), _pow2(head_dv)
    programs = batch * kv_heads
    splits = num_splits or default_splits(programs, kv_len, block_n, query.device)
    keys_per_split = triton.cdiv(triton.cdiv(max(kv_len, 1), splits), block_n) * block_n
    splits = max(1, triton.cdiv(kv_len, keys_per_split))
    if splits > 1:
        part_o = torch.empty((programs * splits, block_m, block_dv), dtype=torch.float32, device=query.device)
        part_m = torch.empty((programs * splits, block_m), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused
    sink_ptr = sinks.to(device=query.device, dtype=torch.float32).contiguous() if sinks is not None else out
    wrap_triton(_segment_attention_kernel)[(programs, splits)](
        query, key, value, out, part_o, part_m, part_l, sink_ptr,
        lo1, hi1, lo2, hi2,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        kv_heads, kv_len, keys_per_split, float(scaling), float(softcap or 1.0),
        Q_LEN=q_len, GROUP=group, HEAD_D=head_dim, HEAD_DV=head_dv,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        NUM_SPLITS=splits, IEEE=query.dtype == torch.float32, UPCAST=_UPCAST_DOTS and query.dtype != torch.float32,
        SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
    )
    if splits > 1:
        wrap_triton(_merge_splits_kernel)[(programs,)](
            part_o, part_m, part_l, out, sink_ptr, *out.stride(), kv_heads,
            Q_LEN=q_len, GROUP=group, HEAD_DV=head_dv, BLOCK_M=block_m, BLOCK_DV=block_dv, NUM_SPLITS=splits,
            HAS_SINKS=sinks is not None,
        )
    return out


@triton.jit
def _window_queries(Q, b, kvh, rows, slots, stride_qb, stride_qh, stride_qw, stride_qd,
                    WINDOW: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Packed rows ``rows`` of KV head ``kvh``: row r is window query ``r % WINDOW`` of query head
    ``kvh*GROUP + r // WINDOW``. Returns the query tile, which rows exist, and each row's slot."""
    row_ok = rows < GROUP * WINDOW
    head = kvh * GROUP + rows // WINDOW
    wi = rows % WINDOW
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + wi[:, None] * stride_qw + d[None, :] * stride_qd,
        mask=row_ok[:, None] & (d[None, :] < HEAD_D), other=0.0,
    )
    return q, row_ok, slots - WINDOW + wi


@triton.jit
def _snapkv_stats_kernel(
    Q, K, Pad, M, L,
    stride_qb, stride_qh, stride_qw, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    kv_heads, slots, scaling,
    WINDOW: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 1: softmax max and normaliser of every (query head, window query) row."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q, row_ok, query_slot = _window_queries(Q, b, kvh, rows, slots, stride_qb, stride_qh, stride_qw, stride_qd,
                                            WINDOW, GROUP, HEAD_D, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    pad = tl.load(Pad + b)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    for n0 in range(pad, slots, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(
            k_base + cols[None, :] * stride_kl + d[:, None] * stride_kd,
            mask=(cols[None, :] < slots) & (d[:, None] < HEAD_D), other=0.0,
        )
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * scaling
        valid = (cols[None, :] <= query_slot[:, None]) & (cols[None, :] < slots) & row_ok[:, None]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m_i = m_new
    out = pid_bh * GROUP * WINDOW + rows
    tl.store(M + out, m_i, mask=row_ok)
    tl.store(L + out, l_i, mask=row_ok)


@triton.jit
def _snapkv_mass_kernel(
    Q, K, Pad, M, L, Out,
    stride_qb, stride_qh, stride_qw, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    kv_heads, slots, scaling,
    WINDOW: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 2: for one block of keys, the probability mass summed over all rows of a KV head."""
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pad = tl.load(Pad + b)
    col_ok = (cols < slots) & (cols >= pad)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(
        K + b * stride_kb + kvh * stride_kh + cols[None, :] * stride_kl + d[:, None] * stride_kd,
        mask=(cols[None, :] < slots) & (d[:, None] < HEAD_D), other=0.0,
    )
    mass = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, GROUP * WINDOW, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q, row_ok, query_slot = _window_queries(Q, b, kvh, rows, slots, stride_qb, stride_qh, stride_qw,
                                                stride_qd, WINDOW, GROUP, HEAD_D, BLOCK_D)
        m_row = tl.load(M + pid_bh * GROUP * WINDOW + rows, mask=row_ok, other=0.0)
        l_row = tl.load(L + pid_bh * GROUP * WINDOW + rows, mask=row_ok, other=1.0)
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * scaling
        # Padding queries (slot < pad) see no key and add nothing.
        valid = col_ok[None, :] & (cols[None, :] <= query_slot[:, None]) & (row_ok & (query_slot >= pad))[:, None]
        p = tl.where(valid, tl.exp(s - m_row[:, None]) / tl.where(l_row == 0.0, 1.0, l_row)[:, None], 0.0)
        mass += tl.sum(p, 0)
    tl.store(Out + pid_bh * slots + cols, mass, mask=cols < slots)


def snapkv_mass(queries, keys, pad, scaling: float) -> torch.Tensor:
    """Triton twin of :func:`hf_magicdec.kernels.reference.snapkv_mass` (same contract), through
    the ``hf_magicdec::snapkv_mass`` operator."""
    return torch.ops.hf_magicdec.snapkv_mass(queries, keys, pad.to(keys.device, torch.int32), float(scaling))


@triton_op("hf_magicdec::snapkv_mass", mutates_args={})
def _snapkv_mass_op(queries: torch.Tensor, keys: torch.Tensor, pad: torch.Tensor, scaling: float) -> torch.Tensor:
    batch, heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    dev = keys.device
    pad = pad.to(dev, torch.int32)
    rows = group * window
    stats_m = torch.empty((batch * kv_heads * rows,), dtype=torch.float32, device=dev)
    stats_l = torch.empty_like(stats_m)
    out = torch.empty((batch, kv_heads, slots), dtype=torch.float32, device=dev)
    block_m, block_n, block_d = 64, 64, _pow2(head_dim)
    strides = (*queries.stride(), *keys.stride())
    meta = dict(WINDOW=window, GROUP=group, HEAD_D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    wrap_triton(_snapkv_stats_kernel)[(batch * kv_heads, triton.cdiv(rows, block_m))](
        queries, keys, pad, stats_m, stats_l, *strides, kv_heads, slots, float(scaling), **meta
    )
    wrap_triton(_snapkv_mass_kernel)[(batch * kv_heads, triton.cdiv(slots, block_n))](
        queries, keys, pad, stats_m, stats_l, out, *strides, kv_heads, slots, float(scaling), **meta
    )
    return out


# Output shapes for tracing (fake tensors): given explicitly, so tracing never runs a kernel body
# (Triton's CPU interpreter would read the fake tensors' memory).
@_segment_attention_op.register_fake
def _(query, key, value, lo1, hi1, lo2, hi2, scaling, softcap, sinks, num_splits):
    batch, heads, q_len, _ = query.shape
    return query.new_empty((batch, q_len, heads, value.shape[-1]))


@_snapkv_mass_op.register_fake
def _(queries, keys, pad, scaling):
    return keys.new_empty((keys.shape[0], keys.shape[1], keys.shape[2]), dtype=torch.float32)
