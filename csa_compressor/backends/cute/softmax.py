"""Softmax pieces shared by the kernels: the exact form of the short windows (the fp32 reference's operation order,
bitwise equal to it), the fast form of the fused tail's short-window backward and the online log2-domain fold of the
grouped kernels.

Exact form: x = score + ape, m = max, e = expf(x - m), the sum left to right, e / sum correctly rounded, and
sums of products in the order of torch's CUDA reduction. Fast form (a tail's contract is one bf16 ulp, not
bitwise): e = ``ex2.approx`` of one fma, one reciprocal per column, products summed by fma. Online form: per
column a running (max, sum e, sum e*v) with exp taken as ``ex2.approx`` of ``fma(x, log2 e, -max * log2 e)``.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .ptx import add_rn, div_markstein, ex2, fma_rn, mul_rn, rcp_rn
from .window import NEG_INF, widen

LOG2E = math.log2(math.e)
# Below this numerator Markstein's remainder could underflow: the exact IEEE division is used.
MARKSTEIN_MIN = 2.0**-100


@cute.jit
def exact_quotients(e, total, pq, first, width: cutlass.Constexpr, slots: cutlass.Constexpr,
                    ratio: cutlass.Constexpr, coff: cutlass.Constexpr):  # fmt: skip
    """pq[i * slots + k] = e[i][k] / total[i], correctly rounded (bitwise the IEEE division); slot k of the window.

    One ``rcp.rn`` per column and three instructions per quotient (Markstein) replace the full division and its
    range check; a thread whose numerators include a tiny nonzero one (e < MARKSTEIN_MIN) takes the plain
    division. Masked slots (the previous half of a segment's first group) hold e = 0, which Markstein's sequence
    divides exactly, so they are left out of that test.
    """
    emin = Float32(1.0)
    emin_prev = Float32(1.0)
    for i in cutlass.range_constexpr(width):
        for k in cutlass.range_constexpr(slots):
            if cutlass.const_expr(coff == 2 and k < ratio):
                emin_prev = cute.arch.fmin(emin_prev, e[i][k])
            else:
                emin = cute.arch.fmin(emin, e[i][k])
    if cutlass.const_expr(coff == 2):
        if not first:
            emin = cute.arch.fmin(emin, emin_prev)
    if emin >= Float32(MARKSTEIN_MIN):
        for i in cutlass.range_constexpr(width):
            y = rcp_rn(total[i])
            for k in cutlass.range_constexpr(slots):
                pq[i * slots + k] = div_markstein(e[i][k], total[i], y)
    else:
        for i in cutlass.range_constexpr(width):
            for k in cutlass.range_constexpr(slots):
                pq[i * slots + k] = e[i][k] / total[i]


def _tree(values: list, combine) -> Float32:
    """``combine`` over ``values`` as a balanced tree: log2(n) dependent steps where a left-to-right chain takes n-1."""
    while len(values) > 1:
        values = [combine(values[j], values[j + 1]) if j + 1 < len(values) else values[j]
                  for j in range(0, len(values), 2)]  # fmt: skip
    return values[0]


def fast_column(x: list, v: list) -> tuple:
    """One column of a window in the fast form: (e, 1 / sum(e), sum(e * v)) of its logits ``x`` and values ``v``,
    e = 2^(x log2 e - max log2 e) by ``ex2.approx`` of one fma, one reciprocal. The max and the sum of e run as
    trees, the sum of e * v as two interleaved fma chains: few dependent steps per column, since the rows' serial
    chains are what the fused kernels wait on, and the fast form's contract allows the reassociation (a few fp32
    ulps)."""
    ml = _tree(list(x), lambda a, b: cute.arch.fmax(a, b, nan=True)) * LOG2E
    e = [ex2(fma_rn(xk, LOG2E, -ml)) for xk in x]
    total = _tree(e, add_rn)
    chains = [mul_rn(e[k], v[k]) for k in range(min(2, len(x)))]
    for k in range(2, len(x)):
        chains[k % 2] = fma_rn(e[k], v[k], chains[k % 2])
    return e, rcp_rn(total), _tree(chains, add_rn)


def fast_pooled(scf, apf, kvw, pq, width: int, slots: int) -> list:
    """The fused tail's backward: the probabilities pq[i * slots + k] = e / sum(e) of the thread's window slots
    and the pooled columns x = sum(e * v) / sum(e) in the fast form (``fast_column``): a third of the exact form's
    instructions, at a few fp32 ulps."""
    scw = [widen(scf[k], width) for k in range(slots)]
    pooled = []
    for i in range(width):
        e, inv, acc = fast_column([scw[k][i] + apf[k][i] for k in range(slots)], [kvw[k][i] for k in range(slots)])
        for k in range(slots):
            pq[i * slots + k] = mul_rn(e[k], inv)
        pooled.append(mul_rn(acc, inv))
    return pooled


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


def exact_probabilities(scf, apf, pq, first, width: int, slots: int, ratio: int, coff: int) -> None:
    """pq[i * slots + k] = softmax of column i over the thread's window slots, in the fp32 reference's order."""
    es = []
    totals = []
    scw = [widen(scf[k], width) for k in range(slots)]
    for i in range(width):
        x = [scw[k][i] + apf[k][i] for k in range(slots)]
        m = x[0]
        for k in range(1, slots):
            m = cute.arch.fmax(m, x[k], nan=True)
        e = [cute.math.exp(x[k] - m) for k in range(slots)]
        total = e[0]
        for k in range(1, slots):
            total = add_rn(total, e[k])
        es.append(e)
        totals.append(total)
    exact_quotients(es, totals, pq, first, width, slots, ratio, coff)


@cute.jit
def online_fold(kvf, scf, apf, vm, vl, va, bi: cutlass.Constexpr, width: cutlass.Constexpr,
                batch: cutlass.Constexpr):  # fmt: skip
    """Fold batch bi into the online (max, sum e, sum e*v) per column, log2 domain: vm holds max(x) * log2 e
    (x = score + ape) and e = 2^(x * log2 e - vm), with the product and the subtraction in one fma."""
    kvw = [widen(kvf[k], width) for k in range(batch)]
    scw = [widen(scf[k], width) for k in range(batch)]
    for i in cutlass.range_constexpr(width):
        x = [scw[k][i] + apf[k][i] for k in range(batch)]
        m = x[0]
        for k in cutlass.range_constexpr(1, batch):
            m = cute.arch.fmax(m, x[k], nan=True)
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
        for k in cutlass.range_constexpr(batch):
            e = ex2(fma_rn(x[k], LOG2E, -msafe))
            total = total + e
            acc = acc + e * kvw[k][i]
        vm[i] = m
        vl[i] = total
        va[i] = acc
