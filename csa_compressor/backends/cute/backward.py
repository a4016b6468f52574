"""CuTe-DSL backward kernel of the compressor pooling (SPEC sections 2-3).

Same thread mapping as the forward (``R`` rows x ``G`` slot groups x ``TC`` column
threads per CTA, ``V`` contiguous columns per thread), but the CTAs are persistent
over a contiguous range of rows (``rows_per_cta``) so that each CTA produces one
fp32 partial of ``grad_ape`` for its column chunk:

- a thread keeps its group's window (kv as bf16, logits as fp32) in registers
  between the max/sum pass and the gradient pass: every input is read once;
- ``G == 1`` (ratio 4 coff 2): the reference's operation order exactly,
  p = exp(x - max) / sum, dv = g*p, gv = g*v, S = sum(gv*p), dlogit = p*(gv - S),
  every multiply/add pinned to ``.rn`` (no fma contraction);
- ``G > 1``: (max, sum e) and then S = sum(gv*p) are combined across groups
  through shared memory in a fixed order;
- grad_ape: per-thread fp32 accumulators over the CTA's rows, summed over the
  CTA's row lanes in a fixed order, written to a workspace slab
  ``ws[cta, ratio, coff*head_dim]``; a second kernel (same host function, same
  stream) sums the slabs in a fixed order into ``grad_ape`` (overwrite, no atomics,
  bitwise deterministic).

Exact zeros (so grad buffers may be uninitialised), each from one owner:
the last group of a segment zeroes the segment's tail tokens (all columns) and,
for coff 2, the first-half columns of its own tokens; CTA ``p`` zeroes the tokens
of the segments ``b = p mod grid`` that have no group, and a grid-stride share of
the tokens past ``cu_seqlens[-1]``.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .forward import (
    NEG_INF,
    Schedule,
    add_rn,
    find_segment,
    make_stage_ape,
    mul_rn,
    slots_per_group,
    sub_rn,
    vec_view,
    vector_width,
)

REDUCE_WARPS = 8


def _logit(scf, sm_ape, abase, k: int, i: int, CW: int):
    """fp32 logit of slot k (of the thread's group), column i: score + ape (ape staged in shared memory)."""
    return Float32(scf[k][i]) + sm_ape[abase + k * CW + i]


@cute.jit
def _acc_if(t: cute.Tensor, q: Int32, v: Float32, pred: Boolean):
    if pred:
        t[q] = add_rn(t[q], v)


def _emit(dvb, dlb, sm_dap, gf, valid, k: int, i: int, p, gv, ssum, q):
    """dv = g*p and dlogit = p*(gv - S) into the bf16 store fragments; grad_ape takes valid slots only."""
    dl = mul_rn(p, sub_rn(gv, ssum))
    dvb[k][i] = BFloat16(mul_rn(gf[i], p))
    dlb[k][i] = BFloat16(dl)
    _acc_if(sm_dap, q, dl, valid)


def backward_schedule(ratio: int, coff: int, head_dim: int) -> Schedule:
    """128-thread persistent CTAs. Big windows get narrow column chunks (TC = 2: 16 columns), so
    that few row ranges (hence few grad_ape workspace slabs) still fill the GPU."""
    V = vector_width(head_dim)
    W = coff * ratio
    SG = slots_per_group(W)
    G = W // SG
    col_threads = -(-head_dim // V)
    if G == 1:
        TC = 1
        while TC * 2 <= col_threads and TC * 2 <= 16:
            TC *= 2
    else:
        TC = 2 if col_threads >= 2 else 1
    while TC * G > 128 and TC > 1:
        TC //= 2
    R = 1
    # grad_ape accumulators take SG*V floats of shared memory per thread: 64 threads for big windows.
    threads = 128 if G == 1 else 64
    while TC * G * R * 2 <= threads:
        R *= 2
    return Schedule(V=V, TC=TC, G=G, SG=SG, R=R)


def build_backward(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function (main kernel + grad_ape reduction kernel).

    Signature: ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
    grad_ape, ws, B, N, T, rows_per_cta, num_ctas, stream)``; ``rows_per_cta`` is a multiple of R,
    ``num_ctas * rows_per_cta >= N``, ``ws`` holds ``num_ctas * ratio * coff * head_dim`` fp32.
    """
    V, TC, G, SG, R = sch.V, sch.TC, sch.G, sch.SG, sch.R
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    NT = sch.threads
    CW = TC * V
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    assert G * SG == W
    SMEM_ROW = G * CW
    LANES = R * G  # threads sharing one column vector (zero duties are spread over them)
    APE_SIZE = ratio * WIDTH
    stage_ape = make_stage_ape(ratio, coff, head_dim, sch)

    @cute.kernel
    def kernel(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        gout: cute.Pointer,
        gkv: cute.Pointer,
        gsc: cute.Pointer,
        ws: cute.Pointer,
        B: Int32,
        N: Int32,
        T: Int32,
        rows_per_cta: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        tc = tidx % TC
        g = (tidx // TC) % G
        rl = tidx // (TC * G)
        lane = rl * G + g
        c = (by * TC + tc) * V
        col_ok = Boolean(True)
        if cutlass.const_expr(not COLS_EXACT):
            col_ok = c < D
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = cuc_t[B]

        smem = cutlass.utils.SmemAllocator()
        sm_ape = smem.allocate_tensor(Float32, cute.make_layout(W * CW), byte_alignment=16)
        # grad_ape accumulators live in shared memory (thread-private columns): registers are kept for
        # the window itself. Layout [(k*V + i)][thread] so that a warp's accesses are conflict-free.
        sm_dap = smem.allocate_tensor(Float32, cute.make_layout(SG * V * NT), byte_alignment=16)
        if cutlass.const_expr(G > 1):
            sm_a = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_b = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_res = smem.allocate_tensor(Float32, cute.make_layout(3 * R * CW), byte_alignment=16)
        stage_ape(ape, sm_ape, tidx, by)
        for q in cutlass.range_constexpr(SG * V):
            sm_dap[q * NT + tidx] = Float32(0.0)
        cute.arch.sync_threads()

        zero = cute.make_rmem_tensor(cute.make_layout(V), BFloat16)
        zero.fill(0.0)
        kvf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        scf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        dvb = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        dlb = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        gf = cute.make_rmem_tensor(cute.make_layout(V), Float32)

        row_begin = bx * rows_per_cta
        for it in cutlass.range(rows_per_cta // R):
            r = row_begin + it * R + rl
            # Rows past the true row count (padding) carry no gradient.
            active = col_ok & (r < N) & (r < nreal)
            t0 = Int32(0)
            first = Boolean(True)
            last = Boolean(False)
            seg_end = Int32(0)
            if active:
                b = find_segment(cuc_t, B, r)
                j = r - cuc_t[b]
                t0 = cu_t[b] + j * ratio
                first = j == 0
                last = r == cuc_t[b + 1] - 1
                seg_end = cu_t[b + 1]

            valid = []
            for k in cutlass.range_constexpr(SG):
                s = g * SG + k
                half = s // ratio
                tok = t0 - (coff - 1) * ratio + s
                vk = active
                if cutlass.const_expr(coff == 2):
                    vk = active & ((half == 1) | (not first))
                valid.append(vk)
                kvf[k].fill(0.0)
                scf[k].fill(NEG_INF)
                off = tok * WIDTH + half * D + c
                if vk:
                    kvf[k].store(vec_view(kv, off, V).load())
                    scf[k].store(vec_view(score, off, V).load())
            gf.fill(0.0)
            if active:
                gf.store(vec_view(gout, r * D + c, V).load().to(Float32))

            abase = g * SG * CW + tc * V
            if cutlass.const_expr(G == 1):
                for i in cutlass.range_constexpr(V):
                    x = [_logit(scf, sm_ape, abase, k, i, CW) for k in range(SG)]
                    m = x[0]
                    for k in cutlass.range_constexpr(1, SG):
                        m = cute.arch.fmax(m, x[k], nan=True)
                    e = [cute.math.exp(x[k] - m) for k in range(SG)]
                    total = e[0]
                    for k in cutlass.range_constexpr(1, SG):
                        total = add_rn(total, e[k])
                    gi = gf[i]
                    p = [e[k] / total for k in range(SG)]
                    gv = [mul_rn(gi, Float32(kvf[k][i])) for k in range(SG)]
                    ssum = mul_rn(gv[0], p[0])
                    for k in cutlass.range_constexpr(1, SG):
                        ssum = add_rn(ssum, mul_rn(gv[k], p[k]))
                    for k in cutlass.range_constexpr(SG):
                        _emit(dvb, dlb, sm_dap, gf, valid[k], k, i, p[k], gv[k], ssum, (k * V + i) * NT + tidx)
            else:
                base = rl * SMEM_ROW + g * CW + tc * V
                rbase = rl * SMEM_ROW + tc * V
                resb = rl * CW + tc * V
                # Pass 1: per-group (max, sum e), combined by group 0 in group order, broadcast.
                for i in cutlass.range_constexpr(V):
                    x = [_logit(scf, sm_ape, abase, k, i, CW) for k in range(SG)]
                    m = x[0]
                    for k in cutlass.range_constexpr(1, SG):
                        m = cute.arch.fmax(m, x[k], nan=True)
                    msafe = m
                    if m == Float32(NEG_INF):
                        msafe = Float32(0.0)
                    total = Float32(0.0)
                    for k in cutlass.range_constexpr(SG):
                        total = add_rn(total, cute.math.exp(x[k] - msafe))
                    sm_a[base + i] = m
                    sm_b[base + i] = total
                cute.arch.sync_threads()
                if g == 0:
                    for i in cutlass.range_constexpr(V):
                        mx = sm_a[rbase + i]
                        for h in cutlass.range_constexpr(1, G):
                            mx = cute.arch.fmax(mx, sm_a[rbase + h * CW + i], nan=True)
                        total = Float32(0.0)
                        for h in cutlass.range_constexpr(G):
                            mh = sm_a[rbase + h * CW + i]
                            scale = Float32(0.0)
                            if mh != Float32(NEG_INF):
                                scale = cute.math.exp(mh - mx)
                            total = add_rn(total, mul_rn(sm_b[rbase + h * CW + i], scale))
                        sm_res[resb + i] = mx
                        sm_res[R * CW + resb + i] = total
                cute.arch.sync_threads()
                # Pass 2: the group's share of S = sum(gv * p), combined in group order.
                for i in cutlass.range_constexpr(V):
                    mx = sm_res[resb + i]
                    total = sm_res[R * CW + resb + i]
                    gi = gf[i]
                    ssum = Float32(0.0)
                    for k in cutlass.range_constexpr(SG):
                        p = cute.math.exp(_logit(scf, sm_ape, abase, k, i, CW) - mx) / total
                        ssum = add_rn(ssum, mul_rn(mul_rn(gi, Float32(kvf[k][i])), p))
                    sm_a[base + i] = ssum
                cute.arch.sync_threads()
                if g == 0:
                    for i in cutlass.range_constexpr(V):
                        ssum = sm_a[rbase + i]
                        for h in cutlass.range_constexpr(1, G):
                            ssum = add_rn(ssum, sm_a[rbase + h * CW + i])
                        sm_res[2 * R * CW + resb + i] = ssum
                cute.arch.sync_threads()
                # Pass 3: gradients (p and gv recomputed: cheaper than keeping them in registers).
                for i in cutlass.range_constexpr(V):
                    mx = sm_res[resb + i]
                    total = sm_res[R * CW + resb + i]
                    ssum = sm_res[2 * R * CW + resb + i]
                    gi = gf[i]
                    for k in cutlass.range_constexpr(SG):
                        p = cute.math.exp(_logit(scf, sm_ape, abase, k, i, CW) - mx) / total
                        _emit(
                            dvb,
                            dlb,
                            sm_dap,
                            gf,
                            valid[k],
                            k,
                            i,
                            p,
                            mul_rn(gi, Float32(kvf[k][i])),
                            ssum,
                            (k * V + i) * NT + tidx,
                        )

            # Stores land where the loads came from (disjoint across rows).
            for k in cutlass.range_constexpr(SG):
                s = g * SG + k
                half = s // ratio
                tok = t0 - (coff - 1) * ratio + s
                if valid[k]:
                    off = tok * WIDTH + half * D + c
                    vec_view(gkv, off, V).store(dvb[k].load())
                    vec_view(gsc, off, V).store(dlb[k].load())

            # Exact zeros owned by a segment's last group.
            if active & last:
                for k in cutlass.range_constexpr(SG):
                    q = g * SG + k
                    if q < ratio:
                        tail_tok = t0 + ratio + q
                        if tail_tok < seg_end:
                            vec_view(gkv, tail_tok * WIDTH + c, V).store(zero.load())
                            vec_view(gsc, tail_tok * WIDTH + c, V).store(zero.load())
                            if cutlass.const_expr(coff == 2):
                                vec_view(gkv, tail_tok * WIDTH + D + c, V).store(zero.load())
                                vec_view(gsc, tail_tok * WIDTH + D + c, V).store(zero.load())
                        if cutlass.const_expr(coff == 2):
                            own_tok = t0 + q
                            vec_view(gkv, own_tok * WIDTH + c, V).store(zero.load())
                            vec_view(gsc, own_tok * WIDTH + c, V).store(zero.load())

        # Exact zeros: segments with no group (seqlen < ratio), CTA bx owns b = bx mod grid.
        if col_ok:
            for b in cutlass.range(bx, B, gdx):
                if cuc_t[b + 1] == cuc_t[b]:
                    for t in cutlass.range(cu_t[b] + lane, cu_t[b + 1], LANES):
                        for h in cutlass.range_constexpr(coff):
                            vec_view(gkv, t * WIDTH + h * D + c, V).store(zero.load())
                            vec_view(gsc, t * WIDTH + h * D + c, V).store(zero.load())
            # Token-capacity padding rows past cu_seqlens[-1]: grid-stride.
            for t in cutlass.range(cu_t[B] + bx * LANES + lane, T, gdx * LANES):
                for h in cutlass.range_constexpr(coff):
                    vec_view(gkv, t * WIDTH + h * D + c, V).store(zero.load())
                    vec_view(gsc, t * WIDTH + h * D + c, V).store(zero.load())

        # grad_ape partial of this CTA: row lanes summed in a fixed order, one slab per CTA.
        cute.arch.sync_threads()
        if (rl == 0) & col_ok:
            dsum = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            for k in cutlass.range_constexpr(SG):
                for i in cutlass.range_constexpr(V):
                    q = (k * V + i) * NT + tidx
                    acc = sm_dap[q]
                    for h in cutlass.range_constexpr(1, R):
                        acc = add_rn(acc, sm_dap[q + h * TC * G])
                    dsum[i] = acc
                s = g * SG + k
                aoff = (s % ratio) * WIDTH + (s // ratio) * D + c
                vec_view(ws, bx * APE_SIZE + aoff, V).store(dsum.load())

    @cute.kernel
    def reduce_kernel(ws: cute.Pointer, gape: cute.Pointer, num_ctas: Int32):
        # 32 consecutive entries per CTA; warp w sums slabs w, w+8, ... ; warp partials summed in order.
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        w = tidx // 32
        e = bx * 32 + lane
        smem = cutlass.utils.SmemAllocator()
        part = smem.allocate_tensor(Float32, cute.make_layout(REDUCE_WARPS * 32), byte_alignment=16)
        ws_t = cute.make_tensor(ws, cute.make_layout(num_ctas * APE_SIZE))
        acc = Float32(0.0)
        if e < APE_SIZE:
            for p in cutlass.range(w, num_ctas, REDUCE_WARPS):
                acc = add_rn(acc, ws_t[p * APE_SIZE + e])
        part[tidx] = acc
        cute.arch.sync_threads()
        if (w == 0) & (e < APE_SIZE):
            tot = part[lane]
            for h in cutlass.range_constexpr(1, REDUCE_WARPS):
                tot = add_rn(tot, part[h * 32 + lane])
            gape_t = cute.make_tensor(gape, cute.make_layout(APE_SIZE))
            gape_t[e] = tot

    smem_bytes = (W * CW + SG * V * NT + (2 * R * SMEM_ROW + 3 * R * CW if G > 1 else 0)) * 4 + 128

    @cute.jit
    def host(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        gout: cute.Pointer,
        gkv: cute.Pointer,
        gsc: cute.Pointer,
        gape: cute.Pointer,
        ws: cute.Pointer,
        B: Int32,
        N: Int32,
        T: Int32,
        rows_per_cta: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        kernel(kv, score, ape, cu, cuc, gout, gkv, gsc, ws, B, N, T, rows_per_cta).launch(
            grid=[num_ctas, NCHUNK, 1], block=[NT, 1, 1], smem=smem_bytes, stream=stream
        )
        reduce_kernel(ws, gape, num_ctas).launch(
            grid=[(APE_SIZE + 31) // 32, 1, 1],
            block=[REDUCE_WARPS * 32, 1, 1],
            smem=REDUCE_WARPS * 32 * 4 + 64,
            stream=stream,
        )

    return host
