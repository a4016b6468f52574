"""Triton backend: every kernel family compiles for sm_90 without a GPU, with and without the fused tail (the
interpreter runs a kernel's Python, not its code generator). A tail-less kernel takes none of the tail's arguments.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# The runtime arguments the tail adds to the window kernels (None without a tail: constexprs, not parameters).
TAIL_ARGS = ("norm_w_ptr", "cos_ptr", "sin_ptr", "max_position", "pos_ptr", "rstd_ptr", "norm_eps", "wws_ptr")
_PTRS = {
    "ape_ptr": "*fp32", "ws_ptr": "*fp32", "stats_ptr": "*fp32", "norm_w_ptr": "*fp32", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "rstd_ptr": "*fp32", "wws_ptr": "*fp32", "dx_ptr": "*fp32", "cu_ptr": "*i32",
    "cu_comp_ptr": "*i32", "pos_ptr": "*i32",
}  # fmt: skip
_INTS = {"N", "T", "B", "n_iter", "tiles_per_prog", "rows_per_prog", "n_compute", "max_position"}
_TAIL = dict(HAS_NORM=True, ROPE_DIM=16, ROPE_INTERLEAVED=True)
_HALF_SPLIT = dict(HAS_NORM=False, ROPE_DIM=16, ROPE_INTERLEAVED=False)


def _cases(forward, forward_long, backward, backward_tail, forward_tail):
    """(name, kernel, constexprs, launch options, tail given) of every family, small tiles (d = 32)."""
    d = dict(HEAD_DIM=32, BLOCK_D=32, VEC=8, N_COL=1)
    short = dict(RATIO=4, SP=4, COFF=2, BLOCK_R=2, PRECISE_EXP=True, MANUAL_RTNE=False, TORCH_ORDER=True, **d)
    long = dict(RATIO=32, COFF=2, LANES=4, CS_IN=4, NCH_HALF=2, MANUAL_RTNE=False, **d)
    bwd_long = dict(RATIO=32, SP=32, COFF=1, LANES=8, CS_IN=4, SWEEP_T=16, SWEEP_D=32, MANUAL_RTNE=False, **d)
    stats = dict(RATIO=32, COFF=2, HEAD_DIM=32, BLOCK_D=32, SLOTS=16, VEC=8, N_COL=1, N_CHUNK=4, SWEEP_T=16,
                 SWEEP_D=32, MANUAL_RTNE=False)  # fmt: skip
    fast = dict(num_warps=4)
    exact = dict(num_warps=4, enable_fp_fusion=False)  # the short windows' launch option
    one_stage = dict(num_warps=4, num_stages=1)
    sweep = dict(SWEEP_T=16, SWEEP_D=32)
    fwd, fwd_long, bwd = forward.csa_fwd_kernel, forward_long.csa_fwd_long_kernel, backward.csa_bwd_kernel
    dx_consts = dict(RATIO=32, HEAD_DIM=32, BLOCK_R=4, BLOCK_D=32, **_HALF_SPLIT)
    # The long-window forward's epilogue: an odd head_dim gathers the interleaved partners across the row.
    epilogue = dict(RATIO=128, HEAD_DIM=32, BLOCK_R=4, BLOCK_D=32, MANUAL_RTNE=False)
    odd = dict(epilogue, HEAD_DIM=27, **_TAIL)
    return [
        ("forward short", fwd, short, exact, False),
        ("forward short, tail", fwd, {**short, **_TAIL}, exact, True),
        ("forward short, tail, tables first", fwd, {**short, **_TAIL, "TABLES_FIRST": True}, exact, True),
        ("forward long, stats", fwd_long, dict(long, WRITE_STATS=True), fast, False),
        ("forward long, depth 2", fwd_long, dict(long, WRITE_STATS=False, DEPTH=2), fast, False),
        ("tail forward", forward_tail.csa_tail_fwd_kernel, {**epilogue, **_TAIL}, fast, True),
        ("tail forward, half-split", forward_tail.csa_tail_fwd_kernel, {**epilogue, **_HALF_SPLIT}, fast, True),
        ("tail forward, odd head_dim", forward_tail.csa_tail_fwd_kernel, odd, fast, True),
        ("backward short", bwd, {**short, **sweep}, exact, False),
        ("backward short, tail", bwd, {**short, **sweep, **_TAIL}, exact, True),
        ("backward long", backward.csa_bwd_long_kernel, bwd_long, fast, False),
        ("backward stats", backward.csa_bwd_stats_kernel, stats, one_stage, False),
        ("backward stats, tail", backward.csa_bwd_stats_kernel, dict(stats, ROW_BLOCK=32, **_TAIL), one_stage, True),
        ("tail dx", backward_tail.csa_tail_dx_kernel, dx_consts, fast, True),
    ]


def _compile(kernel, consts, opts, with_tail) -> tuple[str, list[str]]:
    """PTX of ``kernel`` for sm_90 and its runtime parameters' names; without a tail its arguments are None."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, runtime = {}, {}, []
    for index, name in enumerate(kernel.arg_names):
        param = kernel.params[index]
        absent = name in TAIL_ARGS and (not with_tail or (name in ("norm_w_ptr", "norm_eps", "wws_ptr")
                                                          and not consts.get("HAS_NORM")))  # fmt: skip
        absent = absent or (name == "stats_ptr" and consts.get("WRITE_STATS") is False)
        if name in consts or param.is_constexpr or absent:
            signature[name] = "constexpr"
            constexprs[name] = consts.get(name, None if absent else param.default)
        else:
            signature[name] = _PTRS.get(name, "i32" if name in _INTS else "fp32" if name == "norm_eps" else "*bf16")
            runtime.append(name)
    # A launch specialises every 16-byte aligned pointer not declared otherwise (the API checks kv's and score's
    # alignment): without these attributes the PTX would load bf16 one element at a time.
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
               if signature[p.name].startswith("*") and not p.do_not_specialize_on_alignment}  # fmt: skip
    source = ASTSource(kernel, signature, constexprs, aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=opts)
    return compiled.asm["ptx"], runtime


def main() -> None:
    from csa_compressor.backends.triton import backward, backward_tail, forward, forward_long, forward_tail

    results = {}
    for name, kernel, consts, opts, with_tail in _cases(forward, forward_long, backward, backward_tail, forward_tail):
        try:
            ptx, runtime = _compile(kernel, consts, opts, with_tail)
            params = len(re.findall(r"\.param \.\w+ (?:\.ptr \.global \.align \d+ )?\w+_param_\d+", ptx))
            scalar_bf16_loads = len(re.findall(r"ld\.global[.:\w]*\.b16\b", ptx))
            results[name] = dict(ok=True, runtime=runtime, params=params, scalar_bf16_loads=scalar_bf16_loads)
        except Exception as exc:  # reported by the test, with the compiler's message
            results[name] = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:])
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DISABLE_LINE_INFO"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-m", "tests.backends.test_triton_compile"], cwd=root, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_family_compiles_for_sm90(compiled):
    failed = {name: r["error"] for name, r in compiled.items() if not r["ok"]}
    assert not failed, failed
    assert len(compiled) == 14


def test_a_tailless_launch_takes_no_tail_argument(compiled):
    """Without a tail the kernels' parameters are the pooling's: the tail's arguments are constexpr None."""
    for name, result in compiled.items():
        tail_params = set(result["runtime"]) & set(TAIL_ARGS)
        assert bool(tail_params) == ("tail" in name), (name, result["runtime"])
    plain, fused = compiled["forward short"], compiled["forward short, tail"]
    # The compiled kernel has as many parameters more as the tail passes runtime arguments.
    assert fused["params"] - plain["params"] == len(set(fused["runtime"]) - set(plain["runtime"])) > 0


# Families allowed single-element bf16 reads: the rotation's partner column of grad_out is a gather by nature.
SCALAR_READS = {"backward short, tail", "backward stats, tail", "tail dx"}


def test_window_loads_are_vectors(compiled):
    """The bf16 window reads of the other families are vector loads (the column runs of VEC elements the tiles
    promise), never one element at a time."""
    assert SCALAR_READS <= set(compiled)
    scalar = {
        n: r["scalar_bf16_loads"] for n, r in compiled.items() if n not in SCALAR_READS and r["scalar_bf16_loads"]
    }
    assert not scalar, scalar
    assert compiled["forward short"]["ok"] and compiled["backward short"]["ok"]


if __name__ == "__main__":
    main()
