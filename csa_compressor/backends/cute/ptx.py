"""Inline PTX operations of the cute kernels: fp32 arithmetic with pinned rounding, bf16 widening, exp2, the
correctly rounded quotient, the L2 prefetch, and the store to a cluster peer's shared memory.

The ``.rn``-pinned forms exist because NVVM and ptxas may otherwise contract a multiply and an add into one fma,
which changes results against the fp32 reference that the short-window kernels match bit for bit.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


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


def ptx_f32(text: str, values, *, loc=None, ip=None) -> Float32:
    """The fp32 result ``$0`` of inline PTX over fp32 operands ``$1 ..`` (pure: free to move or remove)."""
    operands = [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    return Float32(inline_ptx(text, operands, "=f" + ",f" * len(operands), T.f32()))


def _binary_rn(op: str):
    @dsl_user_op
    def fn(a, b, *, loc=None, ip=None) -> Float32:
        return ptx_f32(f"{op}.rn.f32 $0, $1, $2;", (a, b), loc=loc, ip=ip)

    fn.__doc__ = f"``{op}.rn.f32``: one rounding, never contracted into an fma."
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
    """The bf16 in the high half of a 32-bit word as fp32 (one mask; exact), where NVVM's own widening of the
    high half takes a byte permute and a shift."""
    w = cutlass.Uint32(word).ir_value(loc=loc, ip=ip)
    return Float32(inline_ptx("and.b32 $0, $1, 0xffff0000;", [w], "=f,r", T.f32()))


@dsl_user_op
def ex2(a, *, loc=None, ip=None) -> Float32:
    """2**a via ``ex2.approx.ftz.f32`` (2 ulp; exact 0 for -inf)."""
    return ptx_f32("ex2.approx.ftz.f32 $0, $1;", (a,), loc=loc, ip=ip)


@dsl_user_op
def rcp_rn(a, *, loc=None, ip=None) -> Float32:
    """Correctly rounded 1/a (``rcp.rn.f32``)."""
    return ptx_f32("rcp.rn.f32 $0, $1;", (a,), loc=loc, ip=ip)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None) -> Float32:
    """a / b correctly rounded (``div.rn.f32``)."""
    return ptx_f32("div.rn.f32 $0, $1, $2;", (a, b), loc=loc, ip=ip)


@dsl_user_op
def sqrt_rn(a, *, loc=None, ip=None) -> Float32:
    """Correctly rounded square root (``sqrt.rn.f32``)."""
    return ptx_f32("sqrt.rn.f32 $0, $1;", (a,), loc=loc, ip=ip)


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


@dsl_user_op
def prefetch_l2(ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """``prefetch.global.L2`` of the 128-byte line holding ``ptr``: no register, no wait, never removed."""
    address = ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)
    inline_ptx("prefetch.global.L2 [$0];", [address], "l", side_effects=True)


@dsl_user_op
def store_to_cluster_peer(shared: cute.Pointer, barrier: cute.Pointer, rank, value, *, loc=None, ip=None) -> None:
    """``value`` (fp32) stored at ``shared``'s place in the shared memory of the cluster's CTA ``rank``, its 4
    bytes counted on that CTA's mbarrier at ``barrier``'s place (``st.async``: no fence, the receiver waits on its
    own mbarrier)."""
    operands = [shared.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                barrier.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                cutlass.Int32(rank).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)]  # fmt: skip
    text = (
        "{\n.reg .b32 %to, %bar;\nmapa.shared::cluster.u32 %to, $0, $2;\nmapa.shared::cluster.u32 %bar, $1, $2;\n"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%to], $3, [%bar];\n}"
    )
    inline_ptx(text, operands, "r,r,r,f,~{memory}", side_effects=True)
