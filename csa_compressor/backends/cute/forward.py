"""CuTe-DSL forward kernel of the compressor pooling (SPEC section 2).

Thread mapping (one CTA = ``R`` rows x ``G`` slot groups x ``TC`` column threads):

- a thread owns ``V`` contiguous columns of one output row (``V = 8`` bf16 = one
  16-byte access when ``head_dim % 8 == 0``; narrower vectors for other head_dims);
- the ``W = coff * ratio`` window slots of a row are split into ``G`` groups of
  ``SG`` slots; a thread issues all ``2 * SG`` loads (kv and score) of its group
  before it uses any of them, so that many bytes are in flight per thread;
- with ``G == 1`` (ratio 4 coff 2: 8 slots) the whole window lives in one thread
  and the softmax follows the fp32 reference's operation order exactly
  (max, e = exp(x - max), l = sum e, p = e / l, out = sum p * v);
- with ``G > 1`` every group computes a local (max, sum e, sum e*v) and group 0
  combines them through shared memory in a fixed order (one barrier).

Every input element is read exactly once from DRAM: slot ``s`` of row ``r``
reads token ``t0 - (coff-1)*ratio + s``, columns ``(s // ratio) * head_dim + c``.
Padding rows (``r >= cu_seqlens_comp[-1]``, only known on the device) use
``t0 = 0`` and behave as a segment's first group. The segment of a row is found
by a binary search over ``cu_seqlens_comp`` on the device (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

NEG_INF = float("-inf")


# fp32 arithmetic with the rounding pinned in PTX (``.rn``): neither NVVM nor ptxas may contract a
# pinned mul + add into an fma, which would change results against the fp32 reference.
def _binary_rn(op: str):
    @dsl_user_op
    def fn(a, b, *, loc=None, ip=None) -> Float32:
        return Float32(
            llvm.inline_asm(
                T.f32(),
                [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
                f"{op}.rn.f32 $0, $1, $2;",
                "=f,f,f",
                has_side_effects=False,
                is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT,
            )
        )

    return fn


mul_rn = _binary_rn("mul")
add_rn = _binary_rn("add")
sub_rn = _binary_rn("sub")


@dataclass(frozen=True)
class Schedule:
    """Compile-time launch shape. ``TC*G*R`` threads per CTA, ``V`` columns per thread."""

    V: int  # columns per thread (vector width in elements)
    TC: int  # column threads per CTA
    G: int  # slot groups per row
    SG: int  # slots per group (G * SG == coff * ratio)
    R: int  # rows per CTA (concurrently)

    @property
    def threads(self) -> int:
        return self.TC * self.G * self.R

    def key(self) -> tuple:
        return (self.V, self.TC, self.G, self.SG, self.R)


def vector_width(head_dim: int) -> int:
    """Widest element vector (<= 16 bytes of bf16) that divides head_dim: every row offset stays aligned."""
    for v in (8, 4, 2, 1):
        if head_dim % v == 0:
            return v
    return 1


def slots_per_group(window: int, cap: int = 8) -> int:
    """Largest power of two <= cap dividing the window (so that groups tile it exactly)."""
    sg = 1
    while sg * 2 <= cap and window % (sg * 2) == 0:
        sg *= 2
    return sg


def forward_schedule(ratio: int, coff: int, head_dim: int) -> Schedule:
    """One schedule per configuration, ~128 threads per CTA (several CTAs per SM overlap their loads).

    The CTA stages its column chunk of ``ape`` in shared memory (``W * TC * V`` floats), so TC is
    capped to keep that (plus the cross-group combine buffers) under ~44 KB.
    """
    V = vector_width(head_dim)
    W = coff * ratio
    SG = slots_per_group(W)
    G = W // SG
    col_threads = -(-head_dim // V)
    TC = 1
    while TC * 2 <= col_threads and TC * 2 * G <= 128 and W * TC * 2 * V * 4 <= 32768:
        TC *= 2
    if G == 1 and col_threads <= 128 and W * col_threads * V * 4 <= 32768:
        TC = col_threads  # a whole row per thread row: odd head_dims keep one chunk
    R = 1
    while TC * G * R * 2 <= 128:
        R *= 2
    return Schedule(V=V, TC=TC, G=G, SG=SG, R=R)


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


def vec_view(ptr: cute.Pointer, off, V: int) -> cute.Tensor:
    """``V`` contiguous elements at ``ptr + off``; ``off`` is a multiple of V, so the access is one vector."""
    return cute.make_tensor(ptr + cute.assume(off, divby=V), cute.make_layout(V))


def make_stage_ape(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """Copy this CTA's column chunk of ape, slot-major ``[W][TC*V]`` fp32, into shared memory.

    Slot ``s`` uses ape row ``s % ratio`` and column half ``s // ratio``. The caller syncs.
    """
    V, TC, NT = sch.V, sch.TC, sch.threads
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    CW = TC * V
    NVEC = W * TC

    @cute.jit
    def stage(ape: cute.Pointer, sm_ape: cute.Tensor, tidx: Int32, by: Int32):
        for idx in cutlass.range(tidx, NVEC, NT):
            s = idx // TC
            cv = idx % TC
            col = by * CW + cv * V
            if col < D:
                src = vec_view(ape, (s % ratio) * WIDTH + (s // ratio) * D + col, V)
                vec_view(sm_ape.iterator, s * CW + cv * V, V).store(src.load())

    return stage


def build_forward(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function for one configuration and schedule.

    Signature: ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, B, N, stream)``
    with bf16/fp32/int32 global pointers, ``B`` segments and ``N = total_comp`` rows.
    """
    V, TC, G, SG, R = sch.V, sch.TC, sch.G, sch.SG, sch.R
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    NT = sch.threads
    CW = TC * V  # columns per CTA
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    assert G * SG == W
    SMEM_ROW = G * CW  # floats per (quantity, row lane)
    stage_ape = make_stage_ape(ratio, coff, head_dim, sch)

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
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        tc = tidx % TC
        g = (tidx // TC) % G
        rl = tidx // (TC * G)
        c = (by * TC + tc) * V
        r = bx * R + rl
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))

        active = r < N
        if cutlass.const_expr(not COLS_EXACT):
            active = active & (c < D)

        smem = cutlass.utils.SmemAllocator()
        sm_ape = smem.allocate_tensor(Float32, cute.make_layout(W * CW), byte_alignment=16)
        stage_ape(ape, sm_ape, tidx, by)

        # Row layout (device-side segment lookup).
        nreal = cuc_t[B]
        t0 = Int32(0)
        first = Boolean(True)
        if active & (r < nreal):
            b = find_segment(cuc_t, B, r)
            j = r - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0

        # Issue every load of the group before any use.
        kvf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        scf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        for k in cutlass.range_constexpr(SG):
            s = g * SG + k
            half = s // ratio
            tok = t0 - (coff - 1) * ratio + s
            valid = active
            if cutlass.const_expr(coff == 2):
                valid = active & ((half == 1) | (not first))
            kvf[k].fill(0.0)
            scf[k].fill(NEG_INF)
            off = tok * WIDTH + half * D + c
            if valid:
                kvf[k].store(vec_view(kv, off, V).load())
                scf[k].store(vec_view(score, off, V).load())
        cute.arch.sync_threads()  # ape staged

        # Logits in fp32: score + ape (invalid slots: -inf + ape = -inf).
        lg = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        for k in cutlass.range_constexpr(SG):
            s = g * SG + k
            lg[k].store(scf[k].load().to(Float32) + vec_view(sm_ape.iterator, s * CW + tc * V, V).load())

        res = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        if cutlass.const_expr(G == 1):
            for i in cutlass.range_constexpr(V):
                m = lg[0][i]
                for k in cutlass.range_constexpr(1, SG):
                    m = cute.arch.fmax(m, lg[k][i], nan=True)
                e = [cute.math.exp(lg[k][i] - m) for k in range(SG)]
                total = e[0]
                for k in cutlass.range_constexpr(1, SG):
                    total = add_rn(total, e[k])
                acc = mul_rn(e[0] / total, Float32(kvf[0][i]))
                for k in cutlass.range_constexpr(1, SG):
                    acc = add_rn(acc, mul_rn(e[k] / total, Float32(kvf[k][i])))
                res[i] = acc
            if active:
                dst = vec_view(out, r * D + c, V)
                dst.store(res.load().to(BFloat16))
        else:
            sm_m = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_l = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_a = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            base = rl * SMEM_ROW + g * CW + tc * V
            for i in cutlass.range_constexpr(V):
                m = lg[0][i]
                for k in cutlass.range_constexpr(1, SG):
                    m = cute.arch.fmax(m, lg[k][i], nan=True)
                # A group whose slots are all masked (previous half of a first group) has m = -inf.
                msafe = m
                if m == Float32(NEG_INF):
                    msafe = Float32(0.0)
                total = Float32(0.0)
                acc = Float32(0.0)
                for k in cutlass.range_constexpr(SG):
                    e = cute.math.exp(lg[k][i] - msafe)
                    total = add_rn(total, e)
                    acc = add_rn(acc, mul_rn(e, Float32(kvf[k][i])))
                sm_m[base + i] = m
                sm_l[base + i] = total
                sm_a[base + i] = acc
            cute.arch.sync_threads()
            if g == 0:
                rbase = rl * SMEM_ROW + tc * V
                for i in cutlass.range_constexpr(V):
                    mx = sm_m[rbase + i]
                    for h in cutlass.range_constexpr(1, G):
                        mx = cute.arch.fmax(mx, sm_m[rbase + h * CW + i], nan=True)
                    total = Float32(0.0)
                    acc = Float32(0.0)
                    for h in cutlass.range_constexpr(G):
                        mh = sm_m[rbase + h * CW + i]
                        scale = Float32(0.0)
                        if mh != Float32(NEG_INF):
                            scale = cute.math.exp(mh - mx)
                        total = add_rn(total, mul_rn(sm_l[rbase + h * CW + i], scale))
                        acc = add_rn(acc, mul_rn(sm_a[rbase + h * CW + i], scale))
                    res[i] = acc / total
                if active:
                    dst = vec_view(out, r * D + c, V)
                    dst.store(res.load().to(BFloat16))

    smem_bytes = W * CW * 4 + (0 if G == 1 else 3 * R * SMEM_ROW * 4) + 64

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
            grid=[(N + R - 1) // R, NCHUNK, 1], block=[NT, 1, 1], smem=smem_bytes, stream=stream
        )

    return host
