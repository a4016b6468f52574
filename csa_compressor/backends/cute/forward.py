"""CuTe-DSL forward kernel of the compressor pooling (SPEC section 2).

Thread mapping (one CTA = ``R`` rows x ``G`` slot groups x ``TC`` column threads):

- a thread owns ``V`` contiguous columns of one output row (``V = 4`` bf16 = one
  8-byte access, ``V = 8`` a 16-byte one; narrower vectors for head_dims that need it);
- the ``W = coff * ratio`` window slots of a row are split into ``G`` groups of
  ``SG <= 8`` slots; a thread issues all ``2 * SG`` loads (kv and score) of its group
  before it uses any of them (ape, L1-resident, is loaded after them), so that many
  bytes are in flight per thread;
- ``G == 1`` (ratio 4 coff 2: 8 slots): the thread owns the whole window;
- ``G > 1``: every group writes a local (max, sum e, sum e*v) to shared memory and,
  after one barrier, one thread per (row, column) combines the G groups in a fixed
  order and writes the output element (column-parallel combine).

Every input element is read exactly once from DRAM: slot ``s`` of row ``r``
reads token ``t0 - (coff-1)*ratio + s``, columns ``(s // ratio) * head_dim + c``.
Padding rows (``r >= cu_seqlens_comp[-1]``, only known on the device) use
``t0 = 0`` and behave as a segment's first group. The segment of a row is found
by a binary search over ``cu_seqlens_comp`` on the device (no host sync).

Numerics: fp32 throughout, one rounding. ``G == 1`` follows the fp32 reference's exact
operation order (libdevice ``expf``, an IEEE division per element, ``.rn``-pinned products and
torch's summation order), which makes it bitwise equal to the reference; ``G > 1`` takes exp
through ``ex2.approx`` of ``fma(x, log2(e), -max * log2(e))`` and combines the groups in a fixed order
(within the contract of ``csa_compressor.testing.contract_report``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

NEG_INF = float("-inf")
# Development switch (read at import): "0" restores the row lookup without the early cu_seqlens load (A/B runs).
_EARLY_CU = os.environ.get("CSA_COMPRESSOR_EARLY_CU", "1") != "0"
# Development switch (read at import), for A/B runs: "0" restores NVVM's widening of bf16 in ``widen`` (every kernel
# that calls it) and the long-window fold's exp as ex2(RN(x * log2 e) - max).
_LEAN_FOLD = os.environ.get("CSA_COMPRESSOR_LEAN_FOLD", "1") != "0"
LOG2E = math.log2(math.e)


def inline_ptx(text: str, operands, constraints: str, result=None, side_effects: bool = False):
    """One inline PTX statement (AT&T operand order): ``result`` is the LLVM type of ``$0`` or None."""
    return llvm.inline_asm(
        result,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def ptx_effect(text: str, operands, constraints: str) -> None:
    """Inline PTX run for its side effect (a prefetch, an asynchronous copy): no result, never removed."""
    inline_ptx(text, operands, constraints, side_effects=True)


def ptx_f32(text: str, values, *, loc=None, ip=None) -> Float32:
    """The fp32 result ``$0`` of inline PTX over fp32 operands ``$1 ..`` (pure: free to move or remove)."""
    operands = [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    return Float32(inline_ptx(text, operands, "=f" + ",f" * len(operands), T.f32()))


# fp32 arithmetic with the rounding pinned in PTX (``.rn``): neither NVVM nor ptxas may contract a
# pinned mul + add into an fma, which would change results against the fp32 reference.
def _binary_rn(op: str):
    @dsl_user_op
    def fn(a, b, *, loc=None, ip=None) -> Float32:
        return ptx_f32(f"{op}.rn.f32 $0, $1, $2;", (a, b), loc=loc, ip=ip)

    return fn


mul_rn = _binary_rn("mul")
add_rn = _binary_rn("add")
sub_rn = _binary_rn("sub")


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """a * b + c with one rounding (``fma.rn.f32``)."""
    return ptx_f32("fma.rn.f32 $0, $1, $2, $3;", (a, b, c), loc=loc, ip=ip)


@dsl_user_op
def bf16_lo(word, *, loc=None, ip=None) -> Float32:
    """The bf16 in the low half of a 32-bit word as fp32 (one shift; exact)."""
    w = cutlass.Uint32(word).ir_value(loc=loc, ip=ip)
    return Float32(inline_ptx("shl.b32 $0, $1, 16;", [w], "=f,r", T.f32()))


@dsl_user_op
def bf16_hi(word, *, loc=None, ip=None) -> Float32:
    """The bf16 in the high half of a 32-bit word as fp32 (one mask; exact). NVVM's own widening of the high
    half takes a byte permute and a shift."""
    w = cutlass.Uint32(word).ir_value(loc=loc, ip=ip)
    return Float32(inline_ptx("and.b32 $0, $1, 0xffff0000;", [w], "=f,r", T.f32()))


def widen_plain(t, V: int) -> list:
    """The V bf16 elements of a register tensor as fp32 values, NVVM's own conversion (for the statistics
    backward, where ``widen``'s form measured slower: see backward_stats.py)."""
    return [Float32(t[i]) for i in range(V)]


def widen(t, V: int) -> list:
    """The V bf16 elements of a register tensor as fp32 values: pairs from 32-bit words where V is even."""
    if not _LEAN_FOLD or V % 2:
        return widen_plain(t, V)
    words = cute.recast_tensor(t, cutlass.Uint32)
    out = []
    for j in range(V // 2):
        out += [bf16_lo(words[j]), bf16_hi(words[j])]
    return out


@dsl_user_op
def ex2(a, *, loc=None, ip=None) -> Float32:
    """2**a via ``ex2.approx.ftz.f32`` (2 ulp; exact 0 for -inf)."""
    return ptx_f32("ex2.approx.ftz.f32 $0, $1;", (a,), loc=loc, ip=ip)


@dsl_user_op
def rcp_rn(a, *, loc=None, ip=None) -> Float32:
    """Correctly rounded 1/a (``rcp.rn.f32``)."""
    return ptx_f32("rcp.rn.f32 $0, $1;", (a,), loc=loc, ip=ip)


@dsl_user_op
def div_markstein(a, b, y, *, loc=None, ip=None) -> Float32:
    """a / b correctly rounded, given y = RN(1/b): q = RN(a*y), r = a - b*q (exact by fma),
    RN(q + r*y) (Markstein's theorem; needs no underflow, i.e. a not tiny)."""
    return ptx_f32(
        "{\n.reg .f32 %mq, %mr;\nmul.rn.f32 %mq, $1, $3;\nneg.f32 %mr, %mq;\n"
        "fma.rn.f32 %mr, %mr, $2, $1;\nfma.rn.f32 $0, %mr, $3, %mq;\n}",
        (a, b, y),
        loc=loc,
        ip=ip,
    )


# Below this numerator Markstein's remainder could underflow: the exact IEEE division is used.
MARKSTEIN_MIN = 2.0**-100


@cute.jit
def exact_quotients(e, total, pq, first, V: cutlass.Constexpr, SG: cutlass.Constexpr, ratio: cutlass.Constexpr,
                    coff: cutlass.Constexpr, md: cutlass.Constexpr):  # fmt: skip
    """pq[i * SG + k] = e[i][k] / total[i], correctly rounded (bitwise the IEEE division); slot k of the window.

    With ``md`` one ``rcp.rn`` per column and three instructions per quotient replace the full
    division (~10 instructions with its range check and slow-path call); a thread whose
    numerators include a tiny nonzero one (e < 2**-100, i.e. x - max < -69) takes the plain
    division. Masked slots (the previous half of a segment's first group) hold e = 0, which
    Markstein's sequence divides exactly, so they are left out of that test.
    """
    if cutlass.const_expr(md):
        emin = Float32(1.0)
        emin_prev = Float32(1.0)
        for i in cutlass.range_constexpr(V):
            for k in cutlass.range_constexpr(SG):
                if cutlass.const_expr(coff == 2 and k < ratio):
                    emin_prev = cute.arch.fmin(emin_prev, e[i][k])
                else:
                    emin = cute.arch.fmin(emin, e[i][k])
        if cutlass.const_expr(coff == 2):
            if not first:
                emin = cute.arch.fmin(emin, emin_prev)
        if emin >= Float32(MARKSTEIN_MIN):
            for i in cutlass.range_constexpr(V):
                y = rcp_rn(total[i])
                for k in cutlass.range_constexpr(SG):
                    pq[i * SG + k] = div_markstein(e[i][k], total[i], y)
        else:
            for i in cutlass.range_constexpr(V):
                for k in cutlass.range_constexpr(SG):
                    pq[i * SG + k] = e[i][k] / total[i]
    else:
        for i in cutlass.range_constexpr(V):
            for k in cutlass.range_constexpr(SG):
                pq[i * SG + k] = e[i][k] / total[i]


def torch_order_sum(vals):
    """Sum in the order of torch's CUDA reduction of a short dimension: accumulator a of four takes
    elements a, a+4, ... (starting from 0), then the accumulators are added left to right."""
    nacc = min(4, len(vals))
    accs = [add_rn(Float32(0.0), vals[a]) for a in range(nacc)]
    for k in range(nacc, len(vals)):
        accs[k % nacc] = add_rn(accs[k % nacc], vals[k])
    total = accs[0]
    for a in range(1, nacc):
        total = add_rn(total, accs[a])
    return total


@dataclass(frozen=True)
class Schedule:
    """Compile-time launch shape. ``TC*G*R`` threads per CTA, ``V`` columns per thread.

    A group streams its ``SG * NB`` slots in ``NB`` batches of ``SG`` (the next batch's loads are
    issued before the current one is used; an online max/sum carries across batches). ``CM``
    (chunk-major) makes the column chunks of one row block adjacent CTAs, so that the pieces of a
    token row are read at about the same time. ``MD`` replaces the IEEE division of each
    ``e / sum`` by Markstein's sequence around one ``rcp.rn`` per column (same result, see
    ``exact_quotients``).
    """

    V: int  # columns per thread (vector width in elements)
    TC: int  # column threads per CTA
    G: int  # slot groups per row
    SG: int  # slots per batch
    R: int  # rows per CTA (concurrently)
    NB: int = 1  # batches per group (G * SG * NB == coff * ratio)
    CM: bool = False  # chunk-major CTA order
    MD: bool = False  # G == 1: divide by the row sum through its correctly rounded reciprocal (Markstein)
    LONG: bool = False  # backward: the two-pass streaming kernel of backward_long.py
    PF: bool = False  # long-window backwards: prefetch ahead (two-pass: next window to L2; statistics: see there)
    AS: bool = False  # long-window backward: rows' windows staged in shared memory by cp.async (2 stages)
    ST: bool = False  # softmax statistics: the forward writes them, the long-window backward reads them
    SC: int = 0  # statistics backward (backward_stats.py): window slots per CTA
    EF: bool = False  # evict-first (``ld.global.cs``) loads of the window's kv, score (short backward: grad_out)
    ES: bool = False  # backward: evict-first (``st.global.cs``) stores of grad_kv and grad_score, zeros included
    MB: int = 0  # resident CTAs per SM that the registers are capped for (launch bounds); 0: the default
    HA: bool = False  # short-window backward: the thread's ape entries held in registers across rows
    CL: bool = False  # statistics backward: a cluster of the row ranges sums grad_ape (no slabs, no second kernel)
    WT: bool = (
        False  # statistics backward: one CTA per tile sums all rows and writes grad_ape (no slabs, no 2nd kernel)
    )

    @property
    def threads(self) -> int:
        return self.TC * self.G * self.R

    @property
    def single_kernel(self) -> bool:
        """Backward: the main kernel writes grad_ape itself (cluster or whole-tile form): no slabs, no reduction."""
        return self.CL or self.WT

    def with_threads(self, threads: int) -> Schedule:
        """The same thread tile in CTAs of ``threads``: only the row lanes ``R`` change."""
        return replace(self, R=max(1, self.R * threads // self.threads))

    def key(self) -> tuple:
        return (
            self.V,
            self.TC,
            self.G,
            self.SG,
            self.R,
            self.NB,
            self.CM,
            self.MD,
            self.LONG,
            self.PF,
            self.AS,
            self.ST,
            self.SC,
            self.EF,
            self.ES,
            self.MB,
            self.HA,
            self.CL,
            self.WT,
        )


def vector_width(head_dim: int, cap: int = 8) -> int:
    """Widest element vector (<= cap) that divides head_dim: every row offset stays aligned."""
    for v in (8, 4, 2, 1):
        if v <= cap and head_dim % v == 0:
            return v
    return 1


def slots_per_group(window: int, cap: int = 8) -> int:
    """Largest power of two <= cap dividing the window (so that groups tile it exactly)."""
    sg = 1
    while sg * 2 <= cap and window % (sg * 2) == 0:
        sg *= 2
    return sg


def make_schedule(
    ratio: int, coff: int, head_dim: int, vcap: int, threads: int, cols_cap: int, sg_cap: int = 8, md: bool = False
) -> Schedule:
    """``threads`` per CTA; at most ``cols_cap`` columns per CTA; V <= vcap; SG <= sg_cap slots per group."""
    V = vector_width(head_dim, vcap)
    W = coff * ratio
    SG = slots_per_group(W, sg_cap)
    G = W // SG
    col_threads = -(-head_dim // V)
    TC = 1
    while TC * 2 <= col_threads and TC * 2 * G <= threads and TC * 2 * V <= cols_cap:
        TC *= 2
    if G == 1 and col_threads <= threads and col_threads * V <= cols_cap and col_threads < 2 * TC:
        TC = col_threads  # odd head_dims: one chunk instead of a ragged second one
    R = 1
    while TC * G * R * 2 <= threads:
        R *= 2
    return Schedule(V=V, TC=TC, G=G, SG=SG, R=R, MD=md and G == 1)


def streaming_schedule(ratio: int, coff: int, head_dim: int, threads: int = 256, cols_cap: int = 256) -> Schedule:
    """Long windows: 16-byte column vectors, wide column chunks (up to ``cols_cap``), at most 8 slot
    groups each streaming batches of 4 slots, chunk-major CTA order."""
    W = coff * ratio
    V = vector_width(head_dim, 8)
    SG = slots_per_group(W, 4)
    batches = W // SG
    G = max(g for g in range(1, 9) if batches % g == 0)
    col_threads = -(-head_dim // V)
    TC = 1
    while TC * 2 <= col_threads and TC * 2 * G <= threads and TC * 2 * V <= cols_cap:
        TC *= 2
    R = 1
    while TC * G * R * 2 <= threads:
        R *= 2
    return Schedule(V=V, TC=TC, G=G, SG=SG, R=R, NB=batches // G, CM=True)


def forward_schedule(ratio: int, coff: int, head_dim: int) -> Schedule:
    W = coff * ratio
    if W <= 8:
        return make_schedule(ratio, coff, head_dim, vcap=4, threads=128, cols_cap=512, md=True)
    if W <= 128:
        # 64-column chunks, one batch of 8 slots per group: more CTAs for the few rows of ratio-128 packs
        # (H200, 3x8192 d512 r128 c1: 20.7 us against 22.5 for the 256-column streaming schedule).
        return replace(make_schedule(ratio, coff, head_dim, vcap=4, threads=256, cols_cap=64), CM=True)
    return streaming_schedule(ratio, coff, head_dim)


# 8-slot windows (G == 1) at 128 threads: the default build takes 95-96 registers (5 CTAs per SM). Capped for 6
# it takes 80 with 2-4 spill instructions (shorter windows take ~52 and hold more CTAs anyway). On the H200 that
# is 4-5 % faster for launches of more than one wave (3x8192 d512 r4 c2 33.4-33.7 -> 32.2 us cold) and 12-15 %
# slower for a single wave (1x8192 d128 r4 c2, 4.35 -> 4.9 us): benchmarks/results/min_blocks_ab_h200_20261201.md.
# launch.forward picks per call. Those register counts were NVVM's widening of bf16; with ``widen`` (b0e0d06) the
# default build takes 64 registers (8 CTAs per SM) and the capped one 80 (6 CTAs per SM), so the cap no longer adds
# a CTA. Measured again after b0e0d06 (benchmarks/results/wide_forward_ab_h200_20261201.md, two passes): the capped
# build is still 1.5-2.6 % faster at 3x8192 d128 (4 rows per CTA) but 2-4 % slower at 1x8192 and 3x8192 d512 (one row
# per CTA: 28.1 against 29.0 us at 3x8192), so only schedules of more than one row per CTA get it.
WIDE_CTAS_PER_SM = 6


def wide_forward_schedule(sch: Schedule) -> Schedule | None:
    """The register-capped form of a short-window forward schedule for large launches, or None."""
    if sch.G != 1 or sch.SG != 8 or sch.MB or sch.threads != 128 or sch.R < 2:
        return None
    return replace(sch, MB=WIDE_CTAS_PER_SM)


# ----------------------------------------------------------------------------------------------
# Device helpers shared with the backward kernel.
# ----------------------------------------------------------------------------------------------


@cute.jit
def find_segment(cuc: cute.Tensor, B: Int32, r: Int32) -> Int32:
    """Largest b in [0, B-1] with cu_seqlens_comp[b] <= r (skips empty segments)."""
    lo = Int32(0)
    hi = B - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if cuc[mid] <= r:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cute.jit
def real_rows(cu_t: cute.Tensor, cuc_t: cute.Tensor, B: Int32) -> Int32:
    """``cu_seqlens_comp[B]``, the real row count, loaded together with ``cu_seqlens[0]``: that makes the line of
    cu_seqlens arrive in L1 with the count, so that a row's first token (``cu_seqlens[b] + j * ratio``, read after
    the search over cu_seqlens_comp) costs no dependent L2 round trip of its own before a CTA's first window loads.
    H200 (benchmarks/results/early_cu_ab_h200_20261201.md): single-wave forwards -6 to -38 %, large launches level;
    the statistics backward level to -2 %; the short-window backward +2 to +4 % at 1x8192 d128 r4 c2 (two more
    registers), so it and the two-pass backward keep the plain load. A negative ``cu_seqlens[0]`` (outside the
    contract, which has it 0) counts no real rows, so every row reads as padding instead of from a negative token."""
    nreal = cuc_t[B]
    if cutlass.const_expr(_EARLY_CU):
        if cu_t[0] < 0:
            nreal = Int32(0)
    return nreal


def vec_view(ptr: cute.Pointer, off, V: int) -> cute.Tensor:
    """``V`` contiguous elements at ``ptr + off``; ``off`` is a multiple of V, so the access is one vector."""
    return cute.make_tensor(ptr + cute.assume(off, divby=V), cute.make_layout(V))


def window_load(ptr: cute.Pointer, off, V: int, evict_first: bool):
    """``vec_view(ptr, off, V).load()``; with ``evict_first`` as ``ld.global.cs`` (SASS ``LDG.E.EF``): data read
    once is cached evict-first in L1 and L2, so a window streaming through L2 replaces its own lines instead of
    evicting other, possibly dirty, ones (whose write-back would share the DRAM bandwidth)."""
    if not evict_first or V == 1:  # NVVM rejects a one-element vector load with a cache operator
        return vec_view(ptr, off, V).load()
    dtype = ptr.dtype
    value = cute.arch.load(ptr + cute.assume(off, divby=V), ir.VectorType.get([V], dtype.mlir_type), cop="cs")
    return cute.TensorSSA(value, (V,), dtype)


def window_store(ptr: cute.Pointer, off, V: int, value, evict_first: bool) -> None:
    """``vec_view(ptr, off, V).store(value)``; with ``evict_first`` as ``st.global.cs`` (SASS ``STG.E.EF``): a
    gradient written once leaves L2 before older (possibly dirty) lines, whose write-back would otherwise share
    the DRAM bandwidth with the kernel's own traffic."""
    if not evict_first or V == 1:  # as window_load: no cache operator on one-element vectors
        vec_view(ptr, off, V).store(value)
        return
    cute.arch.store(ptr + cute.assume(off, divby=V), value, cop="cs")


def forward_smem_bytes(sch: Schedule) -> int:
    """Dynamic shared memory of the forward kernel (cross-group combine buffers)."""
    return 0 if sch.G == 1 else 3 * sch.R * sch.G * sch.TC * sch.V * 4 + 64


def exact_probabilities(scf, apf, pq, first, V: int, SG: int, ratio: int, coff: int, md: bool) -> None:
    """pq[i * SG + k] = softmax of column i over the thread's SG window slots, in the fp32 reference's
    operation order: x = score + ape, m = max, e = expf(x - m), sum left to right, e / sum correctly rounded."""
    es = []
    totals = []
    scw = [widen(scf[k], V) for k in range(SG)]
    for i in range(V):
        x = [scw[k][i] + apf[k][i] for k in range(SG)]
        m = x[0]
        for k in range(1, SG):
            m = cute.arch.fmax(m, x[k], nan=True)
        e = [cute.math.exp(x[k] - m) for k in range(SG)]
        total = e[0]
        for k in range(1, SG):
            total = add_rn(total, e[k])
        es.append(e)
        totals.append(total)
    exact_quotients(es, totals, pq, first, V, SG, ratio, coff, md)


class WindowOps:
    """Device helpers over one thread's window slots, shared by the forward and the long-window backward.

    A thread owns ``V`` columns (from column ``c``) of the ``SPG = SG * NB`` slots of group ``g``, in
    batches of ``SG``; slot ``s`` of a row starting at token ``t0`` reads token ``t0 - (coff-1)*ratio + s``,
    columns ``(s // ratio) * head_dim + c``.
    """

    def __init__(self, ratio: int, coff: int, head_dim: int, V: int, SG: int, SPG: int, evict_first: bool = False):
        D = head_dim
        WIDTH = coff * head_dim

        @cute.jit
        def issue(kv, score, kvf, scf, bi: cutlass.Constexpr, g, c, active, t0, first):
            """Every load (kv and score) of batch bi, issued before any use; masked slots: kv 0, score -inf."""
            for k in cutlass.range_constexpr(SG):
                s = g * SPG + bi * SG + k
                half = s // ratio
                valid = active
                if cutlass.const_expr(coff == 2):
                    valid = active & ((half == 1) | (not first))
                kvf[k].fill(0.0)
                scf[k].fill(NEG_INF)
                tok = t0 - (coff - 1) * ratio + s
                if valid:
                    off = tok * WIDTH + half * D + c
                    kvf[k].store(window_load(kv, off, V, evict_first))
                    scf[k].store(window_load(score, off, V, evict_first))

        @cute.jit
        def load_ape(ape, apf, bi: cutlass.Constexpr, g, c, col_ok):
            """ape is small and L1/L2-resident: loaded after the DRAM loads are in flight."""
            for k in cutlass.range_constexpr(SG):
                s = g * SPG + bi * SG + k
                apf[k].fill(0.0)
                if col_ok:
                    apf[k].store(vec_view(ape, (s % ratio) * WIDTH + (s // ratio) * D + c, V).load())

        @cute.jit
        def online_batch(kvf, scf, apf, vm, vl, va, bi: cutlass.Constexpr):
            """Fold batch bi into the online (max, sum e, sum e*v) per column, log2 domain: vm holds
            max(x) * log2 e (x = score + ape), which is max(RN(x * log2 e)), and e = 2^(x * log2 e - vm)."""
            kvw = [widen(kvf[k], V) for k in range(SG)]
            scw = [widen(scf[k], V) for k in range(SG)]
            for i in cutlass.range_constexpr(V):
                if cutlass.const_expr(_LEAN_FOLD):
                    x = [scw[k][i] + apf[k][i] for k in range(SG)]
                else:  # the previous form: x in the log2 domain, RN(x * log2 e)
                    x = [(scw[k][i] + apf[k][i]) * LOG2E for k in range(SG)]
                m = x[0]
                for k in cutlass.range_constexpr(1, SG):
                    m = cute.arch.fmax(m, x[k], nan=True)
                if cutlass.const_expr(_LEAN_FOLD):
                    m = m * LOG2E
                if cutlass.const_expr(bi > 0):
                    m = cute.arch.fmax(m, vm[i], nan=True)
                # All slots masked so far (previous half of a first group): m = -inf, keep e = 0.
                msafe = m
                if m == Float32(NEG_INF):
                    msafe = Float32(0.0)
                total = Float32(0.0)
                acc = Float32(0.0)
                if cutlass.const_expr(bi > 0):
                    carry = ex2(vm[i] - msafe)
                    total = vl[i] * carry
                    acc = va[i] * carry
                for k in cutlass.range_constexpr(SG):
                    if cutlass.const_expr(_LEAN_FOLD):
                        e = ex2(fma_rn(x[k], LOG2E, -msafe))
                    else:
                        e = ex2(x[k] - msafe)
                    total = total + e
                    acc = acc + e * kvw[k][i]
                vm[i] = m
                vl[i] = total
                va[i] = acc

        self.issue, self.load_ape, self.online_batch = issue, load_ape, online_batch


def build_forward(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function for one configuration and schedule.

    Signature: ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, B, N, stream)``
    with bf16/fp32/int32 global pointers, ``B`` segments and ``N = total_comp`` rows; with ``sch.ST``
    ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, B, N, stream)``, where the kernel
    also writes the softmax statistics ``(N, 3, D)`` fp32 (``reference.softmax_stats``: the log2-domain
    max, 1 / sum and the fp32 output of every row and column).
    """
    V, TC, G, SG, R, NB, CM = sch.V, sch.TC, sch.G, sch.SG, sch.R, sch.NB, sch.CM
    W = coff * ratio
    D = head_dim
    NT = sch.threads
    CW = TC * V  # columns per CTA
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    SPG = SG * NB  # slots per group
    assert G * SPG == W and (G > 1 or NB == 1)
    SMEM_ROW = G * CW  # floats per (quantity, row lane)
    ST = sch.ST
    assert not ST or G > 1, "softmax statistics come from the cross-group combine (long windows)"
    ops = WindowOps(ratio, coff, head_dim, V, SG, SPG, sch.EF)

    @cute.jit
    def body(kv, score, ape, cu, cuc, out, stats, B: Int32, N: Int32):
        """The kernel; ``stats`` is only written (and only a real pointer) with ``ST``."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        chunk = by
        rblk = bx
        if cutlass.const_expr(CM):
            chunk = bx % NCHUNK
            rblk = bx // NCHUNK
        tc = tidx % TC
        g = (tidx // TC) % G
        rl = tidx // (TC * G)
        c = (chunk * TC + tc) * V
        r = rblk * R + rl
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))

        col_ok = Boolean(True)
        if cutlass.const_expr(not COLS_EXACT):
            col_ok = c < D
        active = (r < N) & col_ok

        # Row layout (device-side segment lookup).
        nreal = real_rows(cu_t, cuc_t, B)
        t0 = Int32(0)
        first = Boolean(True)
        if active & (r < nreal):
            b = find_segment(cuc_t, B, r)
            j = r - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0

        # Two register buffers of one batch: batch i + 1 is in flight while batch i is used.
        kvb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        scb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]

        res = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        ops.issue(kv, score, kvb[0], scb[0], 0, g, c, active, t0, first)
        if cutlass.const_expr(G == 1):
            ops.load_ape(ape, apf, 0, g, c, col_ok)
            kvf, scf = kvb[0], scb[0]
            # The fp32 reference's exact operation order: p = expf(x - max) / sum (IEEE division),
            # out = sum(p * v) in the order of torch's reduction (four strided accumulators).
            pq = cute.make_rmem_tensor(cute.make_layout(V * SG), Float32)
            exact_probabilities(scf, apf, pq, first, V, SG, ratio, coff, sch.MD)
            kvw = [widen(kvf[k], V) for k in range(SG)]
            for i in cutlass.range_constexpr(V):
                pv = [mul_rn(pq[i * SG + k], kvw[k][i]) for k in range(SG)]
                res[i] = torch_order_sum(pv)
            if active:
                vec_view(out, r * D + c, V).store(res.load().to(BFloat16))
        else:
            smem = cutlass.memory.SmemAllocator()
            sm_m = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_l = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_a = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            # Online (max, sum e, sum e*v) per column in the log2 domain, carried across batches.
            vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            for bi in cutlass.range_constexpr(NB):
                if cutlass.const_expr(bi + 1 < NB):
                    ops.issue(kv, score, kvb[(bi + 1) % 2], scb[(bi + 1) % 2], bi + 1, g, c, active, t0, first)
                ops.load_ape(ape, apf, bi, g, c, col_ok)
                ops.online_batch(kvb[bi % 2], scb[bi % 2], apf, vm, vl, res, bi)
            base = rl * SMEM_ROW + g * CW + tc * V
            vec_view(sm_m.iterator, base, V).store(vm.load())
            vec_view(sm_l.iterator, base, V).store(vl.load())
            vec_view(sm_a.iterator, base, V).store(res.load())
            cute.arch.sync_threads()
            # Column-parallel combine: one thread per (row lane, column), groups in a fixed order.
            for q in cutlass.range(tidx, R * CW, NT):
                rq = q // CW
                cq = q % CW
                row = rblk * R + rq
                col = chunk * CW + cq
                ok = row < N
                if cutlass.const_expr(not COLS_EXACT):
                    ok = ok & (col < D)
                if ok:
                    qb = rq * SMEM_ROW + cq
                    mx = sm_m[qb]
                    for h in cutlass.range_constexpr(1, G):
                        mx = cute.arch.fmax(mx, sm_m[qb + h * CW], nan=True)
                    total = Float32(0.0)
                    acc = Float32(0.0)
                    for h in cutlass.range_constexpr(G):
                        scale = ex2(sm_m[qb + h * CW] - mx)
                        total = total + sm_l[qb + h * CW] * scale
                        acc = acc + sm_a[qb + h * CW] * scale
                    out_t = cute.make_tensor(out, cute.make_layout(N * D))
                    res_q = acc / total
                    out_t[row * D + col] = BFloat16(res_q)
                    if cutlass.const_expr(ST):
                        st_t = cute.make_tensor(stats, cute.make_layout(N * 3 * D))
                        st_t[row * 3 * D + col] = mx
                        st_t[row * 3 * D + D + col] = Float32(1.0) / total
                        st_t[row * 3 * D + 2 * D + col] = res_q

    smem_bytes = forward_smem_bytes(sch)
    # Long windows: at most 128 registers per thread (two 256-thread CTAs per SM); G == 1 is unbounded.
    # (A carveout hint must come with min_blocks_per_mp > 1, or the DSL queries the device at compile time.)
    LAUNCH_BOUNDS = {}
    if G > 1:
        LAUNCH_BOUNDS = dict(min_blocks_per_mp=max(1, 65536 // (NT * 128)), preferred_smem_carveout=50)
    if sch.MB:
        LAUNCH_BOUNDS = dict(min_blocks_per_mp=sch.MB, preferred_smem_carveout=50)

    def grid_of(N):
        if cutlass.const_expr(CM):
            return [(N + R - 1) // R * NCHUNK, 1, 1]
        return [(N + R - 1) // R, NCHUNK, 1]

    if ST:

        @cute.kernel
        def kernel_st(
            kv: cute.Pointer,
            score: cute.Pointer,
            ape: cute.Pointer,
            cu: cute.Pointer,
            cuc: cute.Pointer,
            out: cute.Pointer,
            stats: cute.Pointer,
            B: Int32,
            N: Int32,
        ):
            body(kv, score, ape, cu, cuc, out, stats, B, N)

        @cute.jit
        def host_st(
            kv: cute.Pointer,
            score: cute.Pointer,
            ape: cute.Pointer,
            cu: cute.Pointer,
            cuc: cute.Pointer,
            out: cute.Pointer,
            stats: cute.Pointer,
            B: Int32,
            N: Int32,
            stream: cuda.CUstream,
        ):
            kernel_st(kv, score, ape, cu, cuc, out, stats, B, N).launch(
                grid=grid_of(N), block=[NT, 1, 1], smem=smem_bytes, stream=stream, **LAUNCH_BOUNDS
            )

        return host_st

    @cute.kernel
    def kernel(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        out: cute.Pointer,
        B: Int32,
        N: Int32,
    ):
        body(kv, score, ape, cu, cuc, out, out, B, N)

    @cute.jit
    def host(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        out: cute.Pointer,
        B: Int32,
        N: Int32,
        stream: cuda.CUstream,
    ):
        kernel(kv, score, ape, cu, cuc, out, B, N).launch(
            grid=grid_of(N), block=[NT, 1, 1], smem=smem_bytes, stream=stream, **LAUNCH_BOUNDS
        )

    return host
