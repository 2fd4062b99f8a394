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
* splits outside a row's key ranges do no work, so ragged rows cost their own length;
* asked for the attention mass per page (``page_size``), the kernel also writes per packed row and
  key block the partial sums of its probabilities per page and the running max they are relative
  to; the row's final max and sum come from it (one split) or the merge, and ``_page_mass_kernel``
  combines them into the mass per page: no second pass over the keys.

Tile sizes, warps, stages and split counts come from :mod:`hf_magicdec.kernels.launch` (pure
functions of shapes, dtype and device); ``segment_attention_launches`` / ``snapkv_launches`` turn
them into the lists of :class:`Launch` that the operators run and that
``tests/kernels/test_aot_compile.py`` compiles for sm_80/89/90 on CPU.

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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.runtime.errors import OutOfResources  # noqa: F401  (caught by the dispatcher)

from .launch import DeviceSpec, device_spec, mass_refusal, mass_units, plan_segment_attention, plan_snapkv

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) computes bf16 `tl.dot` wrongly (3.9):
# there, half-precision tiles are multiplied in fp32; on GPUs they go to the tensor cores.
_UPCAST_DOTS = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Runtime integers that vary during a generation (γ, batch, lengths, splits) or only by model
# (group, KV heads) are not specialised: each new value (or its divisibility by 16) would compile
# a new variant, mid-generation. Head dims stay specialised (Triton then knows them multiples of
# 16, so the masked loads along D stay vectorised).
_SEGMENT_RUNTIME = ["q_len", "group", "kv_heads", "kv_len", "keys_per_split", "num_splits", "has_sinks",
                    "mass_blocks"]


@triton.jit
def _fp32(x):
    """A float argument as fp32. Launched directly, Triton types Python floats fp32; inside a
    ``torch.compile``d step on CUDA, inductor launches the same kernel with them typed fp64
    (``torch/_inductor/codegen/triton_utils.py``), which would carry fp64 into the loop's running
    max (a compile error) and the scores. Cast once, both launch the same fp32 arithmetic."""
    return tl.cast(x, tl.float32)


@triton.jit(do_not_specialize=_SEGMENT_RUNTIME)
def _segment_attention_kernel(
    Q, K, V, Out, PartO, PartM, PartL, Sinks,
    Lo1, Hi1, Lo2, Hi2, MassP, RowM, RowL,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ob, stride_oq, stride_oh, stride_od,
    q_len, group, kv_heads, head_d, head_dv, kv_len, keys_per_split, num_splits, has_sinks, scaling, softcap,
    mass_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, MASS: tl.constexpr, UNITS: tl.constexpr,
):
    """One (row, KV head, key split). With ``MASS`` it also writes into ``MassP``, per packed row and
    key block it walks, the partial sums of ``exp(s - m_block)`` over each ``BLOCK_N / UNITS`` keys
    and the running max ``m_block`` they used (:func:`_store_block_mass`) and, with one split, the
    row's final max and sum (``RowM``, ``RowL``; the merge kernel writes them with several)."""
    scaling, softcap = _fp32(scaling), _fp32(softcap)
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    # 64-bit bases: b * stride_kb passes 2^31 once B*Hkv*L*D does (Llama-3.1-8B: batch 64 x 33K
    # slots); offsets inside one (row, head) tile stay 32-bit (the dispatcher checks their span).
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)
    q, rows, row_ok, head_in_group, qi = _load_queries(Q, b, kvh, q_len, group, head_d, stride_qb, stride_qh,
                                                       stride_qq, stride_qd, BLOCK_M, BLOCK_D)
    shift = q_len - 1 - qi
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    lo1, hi1, lo2, hi2, start, stop = _split_keys(Lo1, Hi1, Lo2, Hi2, b, pid_s, keys_per_split, kv_len)
    if MASS:
        # Blocks aligned to absolute slots, so that each page lies in one block (or spans whole
        # ones); the keys before the row's ranges in the first block are masked like any other.
        start = start // BLOCK_N * BLOCK_N
    # This program's mass partials: 64-bit bases (they pass 2^31 elements at large batch x
    # context); offsets inside stay 32-bit (8 L at most, less than K's span per head).
    mass_at = MassP + pid_bh.to(tl.int64) * mass_blocks * ((UNITS + 1) * group * q_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    for n0 in range(start, stop, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, n0, stop, lo1, hi1, lo2, hi2, shift, rows, row_ok, d, dv,
                                      head_d, head_dv, stride_kl, stride_kd, stride_vl, stride_vd, scaling,
                                      softcap, m_i, l_i, acc, mass_at, group * q_len,
                                      BLOCK_N, IEEE, UPCAST, SOFTCAP, MASS, UNITS)

    # The split count and the sinks are runtime values (their code runs once, after the loop): one
    # kernel whatever the count, with or without sinks. The soft-cap, in the loop, is a constexpr.
    if num_splits == 1:
        if has_sinks != 0:
            m_i, l_i, acc = _add_sink(Sinks, kvh * group + head_in_group, row_ok, m_i, l_i, acc)
        if MASS:
            _store_row_stats(RowM, RowL, pid_bh.to(tl.int64) * (group * q_len) + rows, row_ok, m_i, l_i)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        _store_rows(Out, out, b, kvh * group, head_in_group, qi, row_ok, dv, head_dv,
                    stride_ob, stride_oq, stride_oh, stride_od)
    else:
        part = (pid_bh.to(tl.int64) * num_splits + pid_s) * BLOCK_M
        tl.store(PartO + (part + rows[:, None]) * BLOCK_DV + dv[None, :], acc)
        tl.store(PartM + part + rows, m_i)
        tl.store(PartL + part + rows, l_i)


@triton.jit
def _load_queries(Q, b, kvh, q_len, group, head_d, stride_qb, stride_qh, stride_qq, stride_qd,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_D]`` packed query tile of KV head ``kvh``: row r is query head
    ``kvh*group + r // q_len`` at query position ``r % q_len``. Also returns the row indices, which
    rows exist, and each row's head in the group and query position."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < group * q_len
    head_in_group = rows // q_len
    qi = rows % q_len
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * stride_qb + kvh * group * stride_qh
        + head_in_group[:, None] * stride_qh + qi[:, None] * stride_qq + d[None, :] * stride_qd,
        mask=row_ok[:, None] & (d[None, :] < head_d), other=0.0,
    )
    return q, rows, row_ok, head_in_group, qi


@triton.jit
def _split_keys(Lo1, Hi1, Lo2, Hi2, b, pid_s, keys_per_split, kv_len):
    """Row ``b``'s two key ranges and the keys ``[start, stop)`` split ``pid_s`` walks: only the
    envelope of the ranges is read, so a ragged row costs its own length."""
    lo1 = tl.load(Lo1 + b)
    hi1 = tl.load(Hi1 + b)
    lo2 = tl.load(Lo2 + b)
    hi2 = tl.load(Hi2 + b)
    env_lo = tl.minimum(tl.where(hi1 > lo1, lo1, kv_len), tl.where(hi2 > lo2, lo2, kv_len))
    env_hi = tl.maximum(tl.where(hi1 > lo1, hi1, 0), tl.where(hi2 > lo2, hi2, 0))
    start = tl.maximum(pid_s * keys_per_split, env_lo)
    stop = tl.minimum(tl.minimum((pid_s + 1) * keys_per_split, kv_len), env_hi)
    return lo1, hi1, lo2, hi2, start, stop


@triton.jit
def _attend_block(q, k_base, v_base, n0, stop, lo1, hi1, lo2, hi2, shift, rows, row_ok, d, dv, head_d, head_dv,
                  stride_kl, stride_kd, stride_vl, stride_vd, scaling, softcap, m_i, l_i, acc,
                  mass_at, mass_rows,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
                  MASS: tl.constexpr, UNITS: tl.constexpr):
    """One key block ``[n0, n0 + BLOCK_N)`` of the online softmax: the packed rows' logits over the
    keys their ranges allow, folded into the running max ``m_i``, sum ``l_i`` and output ``acc``.
    With ``MASS``, the block's partial mass sums and running max go out (:func:`_store_block_mass`)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < stop
    k = tl.load(
        k_base + cols[None, :] * stride_kl + d[:, None] * stride_kd,
        mask=col_ok[None, :] & (d[:, None] < head_d), other=0.0,
    )
    s = _dot(q, k, IEEE, UPCAST) * scaling
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
    if MASS:
        _store_block_mass(mass_at, n0 // BLOCK_N, mass_rows, rows, row_ok, p, m_new, BLOCK_N, UNITS)
    v = tl.load(
        v_base + cols[:, None] * stride_vl + dv[None, :] * stride_vd,
        mask=col_ok[:, None] & (dv[None, :] < head_dv), other=0.0,
    )
    if not (IEEE or UPCAST):
        p = p.to(v.dtype)  # probabilities enter the tensor cores in the value dtype
    acc = acc * alpha[:, None] + _dot(p, v, IEEE, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _store_block_mass(mass_at, block, mass_rows, rows, row_ok, p, m_new, BLOCK_N: tl.constexpr,
                      UNITS: tl.constexpr):
    """Key block ``block`` of one program's mass partials (``mass_at``: their base, laid out
    ``[blocks, UNITS + 1, rows]``, consecutive rows in consecutive floats): per packed row, the sum
    of ``p = exp(s - m_new)`` over each of the block's ``UNITS`` runs of ``BLOCK_N / UNITS`` keys,
    then the running max ``m_new`` (``-inf`` where a row has seen no key yet: then ``p`` is 0)."""
    at = mass_at + block * ((UNITS + 1) * mass_rows) + rows
    tl.store(at + UNITS * mass_rows, m_new, mask=row_ok)
    if UNITS == 1:
        tl.store(at, tl.sum(p, 1), mask=row_ok)
    else:
        unit = tl.arange(0, BLOCK_N) // (BLOCK_N // UNITS)
        for u in tl.static_range(UNITS):
            tl.store(at + u * mass_rows, tl.sum(tl.where(unit[None, :] == u, p, 0.0), 1), mask=row_ok)


@triton.jit
def _store_row_stats(RowM, RowL, at, row_ok, m_i, l_i):
    """A packed row's final softmax max (0 where it saw no key nor sink) and sum, sinks included:
    its probability of key j is ``exp(s_j - RowM) / RowL``."""
    tl.store(RowM + at, tl.where(m_i == float("-inf"), 0.0, m_i), mask=row_ok)
    tl.store(RowL + at, l_i, mask=row_ok)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32. fp32 inputs: IEEE (no TF32), so they match the twin; fp16 and
    bf16 go to the tensor cores as they are (their products are exact in fp32: an upcast would
    only push the dot off the tensor cores and spill), except under the interpreter (``UPCAST``),
    whose bf16 dot is wrong in Triton 3.9."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _store_rows(Out, out, b, first_head, head_in_group, qi, row_ok, dv, head_dv,
                stride_ob, stride_oq, stride_oh, stride_od):
    """Store packed rows into the ``[B, q, H, Dv]`` output: row r is head ``first_head + r // q``
    at query position ``r % q``."""
    tl.store(
        Out + b * stride_ob + first_head * stride_oh
        + qi[:, None] * stride_oq + head_in_group[:, None] * stride_oh + dv[None, :] * stride_od,
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < head_dv),
    )


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


@triton.jit(do_not_specialize=["q_len", "group", "kv_heads", "part_rows", "num_splits", "has_sinks"])
def _merge_splits_kernel(
    PartO, PartM, PartL, Out, Sinks, RowM, RowL,
    stride_ob, stride_oq, stride_oh, stride_od,
    q_len, group, kv_heads, head_dv, part_rows, num_splits, has_sinks,
    MERGE_M: tl.constexpr, BLOCK_DV: tl.constexpr, MASS: tl.constexpr,
):
    """Merge the splits of ``MERGE_M`` packed rows (of ``part_rows`` per program of the attention
    kernel): one variant per head width, whatever the attention kernel's row tile. With ``MASS``,
    also each row's final softmax max and sum (:func:`_store_row_stats`)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)
    rows = tl.program_id(1) * MERGE_M + tl.arange(0, MERGE_M)
    dv = tl.arange(0, BLOCK_DV)
    base = pid_bh.to(tl.int64) * num_splits * part_rows
    m_max = tl.full([MERGE_M], float("-inf"), tl.float32)
    for i in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(PartM + base + i * part_rows + rows))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.zeros([MERGE_M], tl.float32)
    acc = tl.zeros([MERGE_M, BLOCK_DV], tl.float32)
    for i in range(num_splits):
        split = base + i * part_rows
        w = tl.exp(tl.load(PartM + split + rows) - m_safe)
        denom += w * tl.load(PartL + split + rows)
        acc += w[:, None] * tl.load(PartO + (split + rows[:, None]) * BLOCK_DV + dv[None, :])
    row_ok = rows < group * q_len
    head_in_group = rows // q_len
    if has_sinks != 0:
        m_max, denom, acc = _add_sink(Sinks, kvh * group + head_in_group, row_ok, m_safe, denom, acc)
    if MASS:
        _store_row_stats(RowM, RowL, pid_bh.to(tl.int64) * (group * q_len) + rows, row_ok, m_max, denom)
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    _store_rows(Out, out, b, kvh * group, head_in_group, rows % q_len, row_ok, dv, head_dv,
                stride_ob, stride_oq, stride_oh, stride_od)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, ``kernel[grid](*args, **kwargs)`` (kwargs: constexprs, ``num_warps``,
    ``num_stages``). The operators run these; ``tests/kernels/test_aot_compile.py`` compiles them."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict


def _run(launches: list[Launch]) -> None:
    for launch in launches:
        wrap_triton(launch.kernel)[launch.grid](*launch.args, **launch.kwargs)


def segment_attention(query, key, value, segments, scaling: float, softcap: float | None = None,
                      sinks: torch.Tensor | None = None, num_splits: int | None = None, page_size: int = 0):
    """Triton twin of :func:`hf_magicdec.kernels.reference.segment_attention` (same contract,
    soft-capping, sinks and the attention mass per page included), through the
    ``hf_magicdec::segment_attention`` operator. Only for calls
    :func:`hf_magicdec.kernels.launch.segment_attention_refusal` accepts (``page_size`` 0 or a power
    of two >= 16): returns ``out``, or ``(out, mass)`` when ``page_size > 0``.

    ``num_splits`` overrides the key-axis split count (tests use it to hit both code paths).
    """
    seg = segments.to(query.device)
    out, mass = torch.ops.hf_magicdec.segment_attention(query, key, value, seg.lo1, seg.hi1, seg.lo2, seg.hi2,
                                                        float(scaling), softcap, sinks, num_splits or 0,
                                                        int(page_size))
    return (out, mass) if page_size else out


# The page-mass epilogue's tile: pages per program, packed rows per step (fixed, so that a changing
# γ or group compiles nothing new).
_MASS_PAGES_TILE = 32
_MASS_ROWS_TILE = 16


@triton.jit(do_not_specialize=["kv_heads", "mass_rows", "mass_blocks", "kv_len", "pages", "runs_per_page"])
def _page_mass_kernel(
    MassP, RowM, RowL, Lo1, Hi1, Lo2, Hi2, Mass,
    kv_heads, mass_rows, mass_blocks, kv_len, pages, runs_per_page,
    BLOCK_N: tl.constexpr, UNITS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """The epilogue of a mass-emitting launch: for ``BLOCK_P`` pages of one (row, KV head),
    ``mass = Σ_rows sums · exp(m_block - row_max) / row_sum`` over the page's ``runs_per_page``
    runs of ``BLOCK_N / UNITS`` keys (a page is one run, or whole key blocks). Only the blocks the
    attention kernel walked are read (the others were never written: their pages get 0)."""
    pid = tl.program_id(0)
    page = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    b = (pid // kv_heads).to(tl.int64)
    # The envelope of the row's ranges, as the attention kernel walks it, splits together.
    _, _, _, _, start, stop = _split_keys(Lo1, Hi1, Lo2, Hi2, b, 0, kv_len, kv_len)
    first = start // BLOCK_N * BLOCK_N
    # 64-bit bases (the partials pass 2^31 elements at scale), 32-bit offsets inside one program.
    mass_at = MassP + pid.to(tl.int64) * mass_blocks * ((UNITS + 1) * mass_rows)
    rows_at = pid.to(tl.int64) * mass_rows
    total = tl.zeros([BLOCK_P], tl.float32)
    for k in range(runs_per_page):
        run = page * runs_per_page + k
        block = run // UNITS
        walked = (block * BLOCK_N >= first) & (block * BLOCK_N < stop) & (page < pages)
        for r0 in range(0, mass_rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < mass_rows
            row_max = tl.load(RowM + rows_at + r, mask=r_ok, other=0.0)
            row_sum = tl.load(RowL + rows_at + r, mask=r_ok, other=1.0)
            row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)  # a row that saw nothing has no mass
            ok = walked[:, None] & r_ok[None, :]
            at = mass_at + (block * (UNITS + 1))[:, None] * mass_rows + r[None, :]
            sums = tl.load(at + (run % UNITS)[:, None] * mass_rows, mask=ok, other=0.0)
            m_block = tl.load(at + UNITS * mass_rows, mask=ok, other=float("-inf"))
            share = sums * tl.exp(m_block - row_max[None, :]) / row_sum[None, :]
            total += tl.sum(tl.where(ok, share, 0.0), 1)
    tl.store(Mass + pid.to(tl.int64) * pages + page, total, mask=page < pages)


def _mass_launch(lo1, hi1, lo2, hi2, batch: int, kv_heads: int, rows: int, kv_len: int, page_size: int,
                 block_n: int, dev) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, Launch]:
    """What a mass-emitting launch writes besides the output, all fp32, ``P = B * Hkv`` programs,
    ``R = g * q`` packed rows, ``N`` key blocks per program (enough for whole pages), ``U`` runs
    of keys per block (:func:`hf_magicdec.kernels.launch.mass_units`): the partials ``[P, N, U + 1,
    R]`` (each block's ``U`` partial sums, then the running max they are relative to) and each
    row's final max and sum ``[P, R]`` (unfilled: the attention kernel and the merge fill them, and
    walk only the blocks of a row's ranges); then the mass ``[B, Hkv, pages]`` (unfilled) and the
    epilogue that fills it."""
    pages = triton.cdiv(kv_len, page_size)
    blocks = triton.cdiv(pages * page_size, block_n)
    units = mass_units(page_size, block_n)
    programs = batch * kv_heads
    f32 = {"dtype": torch.float32, "device": dev}
    parts = (torch.empty((programs, blocks, units + 1, rows), **f32), torch.empty((programs, rows), **f32),
             torch.empty((programs, rows), **f32))
    mass = torch.empty((batch, kv_heads, pages), **f32)
    runs_per_page = page_size // (block_n // units)
    epilogue = Launch(_page_mass_kernel, (programs, triton.cdiv(pages, _MASS_PAGES_TILE)), (
        *parts, lo1, hi1, lo2, hi2, mass, kv_heads, rows, blocks, kv_len, pages, runs_per_page,
    ), {"BLOCK_N": block_n, "UNITS": units, "BLOCK_P": _MASS_PAGES_TILE, "BLOCK_R": _MASS_ROWS_TILE,
        "num_warps": 4, "num_stages": 1})
    return parts, mass, epilogue


def segment_attention_launches(query, key, value, lo1, hi1, lo2, hi2, scaling: float, softcap: float | None,
                               sinks: torch.Tensor | None, num_splits: int, spec: DeviceSpec,
                               page_size: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, list[Launch]]:
    """``(out, mass, launches)``: the output ``[B, q, H, Dv]`` and the mass ``[B, Hkv, pages]``
    (unfilled; None when ``page_size`` is 0: no mass written, no epilogue), and the launches that fill
    them on ``spec``.

    Tensors as in :func:`segment_attention`, ``lo1 .. hi2`` ``[B]`` int32; buffers are allocated
    on the query's device, which may be ``meta`` (the AOT test). ``num_splits`` 0: automatic."""
    if page_size and mass_refusal(page_size):
        raise ValueError(mass_refusal(page_size))
    batch, heads, q_len, head_d = query.shape
    kv_heads, kv_len, head_dv = key.shape[1], key.shape[2], value.shape[-1]
    group = heads // kv_heads
    plan = plan_segment_attention(batch, kv_heads, group, q_len, head_d, head_dv, kv_len, query.dtype, spec,
                                  num_splits or None)
    dev = query.device
    out = torch.empty((batch, q_len, heads, head_dv), dtype=query.dtype, device=dev)
    programs = batch * kv_heads
    # Unused pointers get an fp32 placeholder: the pointer types stay those of the split path, so
    # one split or several launch the same compiled kernel (and the mass pointers those of MASS).
    unused = torch.empty((1,), dtype=torch.float32, device=dev)
    if plan.splits > 1:
        part_o = torch.empty((programs * plan.splits, plan.block_m, plan.block_dv), dtype=torch.float32, device=dev)
        part_m = torch.empty((programs * plan.splits, plan.block_m), dtype=torch.float32, device=dev)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = unused
    parts, mass, epilogue = (_mass_launch(lo1, hi1, lo2, hi2, batch, kv_heads, group * q_len, kv_len, page_size,
                                          plan.block_n, dev) if page_size else ((unused,) * 3, None, None))
    sink_ptr = sinks.to(device=dev, dtype=torch.float32).contiguous() if sinks is not None else unused
    attend = Launch(_segment_attention_kernel, (programs, plan.splits), (
        query, key, value, out, part_o, part_m, part_l, sink_ptr, lo1, hi1, lo2, hi2, *parts,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        q_len, group, kv_heads, head_d, head_dv, kv_len, plan.keys_per_split, plan.splits, int(sinks is not None),
        float(scaling), float(softcap or 1.0), parts[0].shape[1] if page_size else 0,
    ), {
        "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_D": plan.block_d, "BLOCK_DV": plan.block_dv,
        "IEEE": query.dtype == torch.float32, "UPCAST": _UPCAST_DOTS and query.dtype != torch.float32,
        "SOFTCAP": softcap is not None, "MASS": bool(page_size), "UNITS": parts[0].shape[2] - 1 if page_size else 1,
        "num_warps": plan.num_warps, "num_stages": plan.num_stages,
    })
    launches = [attend]
    if plan.splits > 1:
        launches.append(Launch(_merge_splits_kernel, (programs, triton.cdiv(group * q_len, plan.merge_m)), (
            part_o, part_m, part_l, out, sink_ptr, *parts[1:], *out.stride(), q_len, group, kv_heads, head_dv,
            plan.block_m, plan.splits, int(sinks is not None),
        ), {"MERGE_M": plan.merge_m, "BLOCK_DV": plan.block_dv, "MASS": bool(page_size),
            "num_warps": plan.merge_warps, "num_stages": 1}))
    return out, mass, launches + ([epilogue] if page_size else [])


@triton_op("hf_magicdec::segment_attention", mutates_args={})
def _segment_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo1: torch.Tensor,
                          hi1: torch.Tensor, lo2: torch.Tensor, hi2: torch.Tensor, scaling: float,
                          softcap: float | None, sinks: torch.Tensor | None, num_splits: int,
                          page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, mass)``: ``mass [B, Hkv, ceil(L / page_size)]`` when ``page_size > 0``, else an
    empty ``[B, Hkv, 0]`` (one schema for both)."""
    out, mass, launches = segment_attention_launches(query, key, value, lo1, hi1, lo2, hi2, scaling, softcap, sinks,
                                                     num_splits, device_spec(query.device), page_size)
    _run(launches)
    if mass is None:
        return out, key.new_empty((key.shape[0], key.shape[1], 0), dtype=torch.float32)
    return out, mass


@triton.jit
def _window_queries(Q, b, kvh, rows, group, window, head_d, slots, stride_qb, stride_qh, stride_qw, stride_qd,
                    BLOCK_D: tl.constexpr):
    """Packed rows ``rows`` of KV head ``kvh``: row r is window query ``r % window`` of query head
    ``kvh*group + r // window``. Returns the query tile, which rows exist, and each row's slot."""
    row_ok = rows < group * window
    wi = rows % window
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * stride_qb + kvh * group * stride_qh
        + (rows // window)[:, None] * stride_qh + wi[:, None] * stride_qw + d[None, :] * stride_qd,
        mask=row_ok[:, None] & (d[None, :] < head_d), other=0.0,
    )
    return q, row_ok, slots - window + wi


# SnapKV runs once per prompt, but group and window (and the prompt length) vary by model and call.
_SNAPKV_RUNTIME = ["group", "window", "kv_heads", "slots"]


@triton.jit(do_not_specialize=_SNAPKV_RUNTIME)
def _snapkv_stats_kernel(
    Q, K, Pad, M, L,
    stride_qb, stride_qh, stride_qw, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    group, window, kv_heads, head_d, slots, scaling,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Pass 1: softmax max and normaliser of every (query head, window query) row."""
    scaling = _fp32(scaling)
    pid_bh = tl.program_id(0)
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    q, row_ok, query_slot = _window_queries(Q, b, kvh, rows, group, window, head_d, slots,
                                            stride_qb, stride_qh, stride_qw, stride_qd, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    pad = tl.load(Pad + b)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    for n0 in range(pad, slots, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(
            k_base + cols[None, :] * stride_kl + d[:, None] * stride_kd,
            mask=(cols[None, :] < slots) & (d[:, None] < head_d), other=0.0,
        )
        s = _dot(q, k, IEEE, UPCAST) * scaling
        valid = (cols[None, :] <= query_slot[:, None]) & (cols[None, :] < slots) & row_ok[:, None]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m_i = m_new
    out = pid_bh.to(tl.int64) * group * window + rows
    tl.store(M + out, m_i, mask=row_ok)
    tl.store(L + out, l_i, mask=row_ok)


@triton.jit(do_not_specialize=_SNAPKV_RUNTIME)
def _snapkv_mass_kernel(
    Q, K, Pad, M, L, Out,
    stride_qb, stride_qh, stride_qw, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    group, window, kv_heads, head_d, slots, scaling,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Pass 2: for one block of keys, the probability mass summed over all rows of a KV head."""
    scaling = _fp32(scaling)
    pid_bh = tl.program_id(0)
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pad = tl.load(Pad + b)
    col_ok = (cols < slots) & (cols >= pad)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(
        K + b * stride_kb + kvh * stride_kh + cols[None, :] * stride_kl + d[:, None] * stride_kd,
        mask=(cols[None, :] < slots) & (d[:, None] < head_d), other=0.0,
    )
    stats = pid_bh.to(tl.int64) * group * window
    mass = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, group * window, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q, row_ok, query_slot = _window_queries(Q, b, kvh, rows, group, window, head_d, slots,
                                                stride_qb, stride_qh, stride_qw, stride_qd, BLOCK_D)
        m_row = tl.load(M + stats + rows, mask=row_ok, other=0.0)
        l_row = tl.load(L + stats + rows, mask=row_ok, other=1.0)
        s = _dot(q, k, IEEE, UPCAST) * scaling
        # Padding queries (slot < pad) see no key and add nothing.
        valid = col_ok[None, :] & (cols[None, :] <= query_slot[:, None]) & (row_ok & (query_slot >= pad))[:, None]
        p = tl.where(valid, tl.exp(s - m_row[:, None]) / tl.where(l_row == 0.0, 1.0, l_row)[:, None], 0.0)
        mass += tl.sum(p, 0)
    tl.store(Out + pid_bh.to(tl.int64) * slots + cols, mass, mask=cols < slots)


def snapkv_mass(queries, keys, pad, scaling: float) -> torch.Tensor:
    """Triton twin of :func:`hf_magicdec.kernels.reference.snapkv_mass` (same contract), through
    the ``hf_magicdec::snapkv_mass`` operator. Only for calls
    :func:`hf_magicdec.kernels.launch.snapkv_refusal` accepts."""
    return torch.ops.hf_magicdec.snapkv_mass(queries, keys, pad.to(keys.device, torch.int32), float(scaling))


def snapkv_launches(queries, keys, pad, scaling: float, spec: DeviceSpec) -> tuple[torch.Tensor, list[Launch]]:
    """The output ``[B, Hkv, S]`` fp32 (unfilled) and the two launches that fill it on ``spec``.

    ``queries [B, H, w, D]``, ``keys [B, Hkv, S, D]``, ``pad [B]`` int32 on the keys' device (may
    be ``meta``)."""
    batch, heads, window, head_d = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    plan = plan_snapkv(head_d, queries.dtype, spec)
    dev = keys.device
    stats_m = torch.empty((batch * kv_heads * group * window,), dtype=torch.float32, device=dev)
    stats_l = torch.empty_like(stats_m)
    out = torch.empty((batch, kv_heads, slots), dtype=torch.float32, device=dev)
    args = (*queries.stride(), *keys.stride(), group, window, kv_heads, head_d, slots, float(scaling))
    meta = {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_D": plan.block_d,
            "IEEE": queries.dtype == torch.float32, "UPCAST": _UPCAST_DOTS and queries.dtype != torch.float32}
    stats = Launch(_snapkv_stats_kernel, (batch * kv_heads, triton.cdiv(group * window, plan.block_m)),
                   (queries, keys, pad, stats_m, stats_l, *args),
                   {**meta, "num_warps": plan.num_warps, "num_stages": plan.stats_stages})
    mass = Launch(_snapkv_mass_kernel, (batch * kv_heads, triton.cdiv(slots, plan.block_n)),
                  (queries, keys, pad, stats_m, stats_l, out, *args),
                  {**meta, "num_warps": plan.num_warps, "num_stages": plan.mass_stages})
    return out, [stats, mass]


@triton_op("hf_magicdec::snapkv_mass", mutates_args={})
def _snapkv_mass_op(queries: torch.Tensor, keys: torch.Tensor, pad: torch.Tensor, scaling: float) -> torch.Tensor:
    out, launches = snapkv_launches(queries, keys, pad.to(keys.device, torch.int32), scaling,
                                    device_spec(keys.device))
    _run(launches)
    return out


# Output shapes for tracing (fake tensors): given explicitly, so tracing never runs a kernel body
# (Triton's CPU interpreter would read the fake tensors' memory).
@_segment_attention_op.register_fake
def _(query, key, value, lo1, hi1, lo2, hi2, scaling, softcap, sinks, num_splits, page_size):
    batch, heads, q_len, _ = query.shape
    pages = -(-key.shape[2] // page_size) if page_size > 0 else 0
    return (query.new_empty((batch, q_len, heads, value.shape[-1])),
            key.new_empty((batch, key.shape[1], pages), dtype=torch.float32))


@_snapkv_mass_op.register_fake
def _(queries, keys, pad, scaling):
    return keys.new_empty((keys.shape[0], keys.shape[1], keys.shape[2]), dtype=torch.float32)
