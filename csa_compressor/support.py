"""Input validation: the bounds of SPEC section 4 in one table, each with an error that names it.

Every bound is written once, as a ``Bound``: a test (a Python expression over the names of the check),
the bound as the error names it, and what was found. Two kinds of function are generated from the
table (``_generate``):

- the full checks (``check_forward`` / ``check_backward``, run by ``check_support``) test every bound
  in table order and raise ``ValueError`` at the first that fails;
- the per-call rechecks (``Config.recheck_*``, run by ``execute`` and the wrappers) test the bounds
  marked ``per_call`` as one boolean expression of attribute reads (no torch op, no CUDA query), with
  the compiled configuration's values bound as constants. Any failure reruns the full check on the
  call's arguments, so a bad argument gets the same error on every call as from ``check_support``.

Scalars (``ratio``, ``coff``, ``head_dim``, ``total_comp``) are exact integers: ``int`` or an integral
type such as ``numpy.int64``, converted with ``operator.index``; ``bool`` and ``float`` (even ``4.0``)
are rejected.
"""

from __future__ import annotations

import functools
import numbers
import operator
import os
import re
from dataclasses import dataclass, field

import torch

from .windows import uses_softmax_stats

__all__ = [
    "MAX_RATIO",
    "VALIDATE_ENV_VAR",
    "VARIANTS",
    "Bind",
    "Bound",
    "Config",
    "check_backward",
    "check_backward_fresh",
    "check_config",
    "check_forward",
    "check_forward_fresh",
    "check_offsets",
    "check_rows_need_tokens",
    "check_total_comp",
    "check_total_comp_rows",
    "check_total_tokens",
    "validation_env",
    "validation_requested",
]

MAX_RATIO = 256
INT32_LIMIT = 2**31
VALUE_DTYPES = (torch.bfloat16,)
F32, I32 = torch.float32, torch.int32


@dataclass(frozen=True)
class Bound:
    """One bound. ``test`` holds for valid arguments; the error names ``bound`` and says what was ``found``
    (both f-string bodies over the check's names). ``per_call=False``: fixed once the configuration is
    (a scalar, the dtype family) or implied per call by the recheck's shape unpacking (a rank)."""

    test: str
    bound: str
    found: str
    per_call: bool = True


@dataclass(frozen=True)
class Bind:
    """``names = expr`` for the bounds after it. Per call, shape unpackings also test ranks (a wrong rank
    raises inside the recheck, which then reruns the full check); ``per_call=False``: full checks only."""

    names: str
    expr: str
    per_call: bool = True


# Where a full check takes the configuration's values: derived from the call, or given (softmax_stats).
_DERIVE, _GIVEN = "derive", "given"
_CONSTANTS = "DTYPE, WIDTH, HEAD_DIM, RATIO, COFF, APE_SHAPE, DEVICE, CUDA_INDEX, USES_STATS"

# ``t.device == DEVICE`` builds a torch.device per read; the rechecks read the device as cheaply as is exact for
# the configuration's device type (get_device() is -1 for CPU and meta alike, so it serves CUDA only).
_DEVICE_TEST = re.compile(r"(\w+)\.device == DEVICE")
_DEVICE_TESTS = {"cuda": r"\1.get_device() == CUDA_INDEX", "cpu": r"\1.is_cpu", "meta": r"\1.is_meta"}


def _cuda_index(device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


@dataclass(frozen=True)
class Config:
    """What a compiled kernel depends on (sizes T and N are runtime values), with its per-call rechecks."""

    ratio: int
    coff: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    width: int = field(init=False, compare=False)
    constants: tuple = field(init=False, compare=False, repr=False)
    # Generated from the table with this configuration's values as constants (see _generate).
    recheck_forward: object = field(init=False, compare=False, repr=False)
    recheck_forward_fresh: object = field(init=False, compare=False, repr=False)
    recheck_backward: object = field(init=False, compare=False, repr=False)
    recheck_backward_fresh: object = field(init=False, compare=False, repr=False)
    recheck_stats: object = field(init=False, compare=False, repr=False)
    recheck_rstd: object = field(init=False, compare=False, repr=False)
    recheck_grad_norm_weight: object = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        width = self.coff * self.head_dim
        constants = (
            self.dtype,
            width,
            self.head_dim,
            self.ratio,
            self.coff,
            (self.ratio, width),
            self.device,
            _cuda_index(self.device),
            uses_softmax_stats(self.ratio, self.coff),
        )
        object.__setattr__(self, "width", width)
        object.__setattr__(self, "constants", constants)
        factories = _RECHECK_FACTORIES.get(self.device.type, _RECHECK_FACTORIES["other"])
        for name, make in factories.items():
            object.__setattr__(self, f"recheck_{name}", make(self))


def _fail(bound: str, detail: str):
    raise ValueError(f"csa_compressor: {bound}: {detail}")


def _exact_int(value):
    """``value`` as an int when it is an exact integer (not bool), else unchanged (the bound then names it)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return operator.index(value)
    return value


# ---------------------------------------------------------------- the table


def _is_tensor(name):
    return Bound(f"isinstance({name}, Tensor)", f"{name} must be a tensor", f"got {{type({name}).__name__}}", False)


def _rank(name, rank):
    return Bound(
        f"{name}.dim() == {rank}", f"{name} must have rank {rank}", f"got shape {{tuple({name}.shape)}}", False
    )


def _layout(name, dtype, align):
    """dtype (an expression naming it), contiguity and alignment of one operand."""
    return (
        Bound(f"{name}.dtype is {dtype}", f"{name} dtype must be {{{dtype}}}", f"got {{{name}.dtype}}"),
        Bound(
            f"{name}.is_contiguous()",
            f"{name} must be contiguous",
            f"got strides {{{name}.stride()}} for shape {{tuple({name}.shape)}}",
        ),
        Bound(
            f"not {name}.data_ptr() & {align - 1}",
            f"{name} must be {align}-byte aligned",
            f"data_ptr() % {align} = {{{name}.data_ptr() % {align}}}",
        ),
    )


def _device(name):
    # The rechecks read the device the cheapest exact way for the configuration's device type (_DEVICE_TESTS).
    return Bound(
        f"{name}.device == DEVICE",
        "all tensors must be on one device",
        f"{name} is on {{{name}.device}}, not {{DEVICE}}",
    )


def _shape(name, shape):
    """``name.shape == shape`` (an expression; its value is named in the error)."""
    return Bound(f"{name}.shape == {shape}", f"{name} shape must be {{tuple({shape})}}", f"got {{tuple({name}.shape)}}")


def _operand(name, rank, dtype, align, shape):
    return (_is_tensor(name), _rank(name, rank), *_layout(name, dtype, align), _shape(name, shape), _device(name))


SCALARS = (
    Bind("ratio, coff, head_dim", "_exact_int(ratio), _exact_int(coff), _exact_int(head_dim)", per_call=False),
    Bound(
        "type(ratio) is int and 1 <= ratio <= MAX_RATIO",
        "ratio must be an int in [1, {MAX_RATIO}]",
        "got ratio={ratio!r}",
        False,
    ),
    Bound("type(coff) is int and coff in (1, 2)", "coff must be 1 or 2", "got coff={coff!r}", False),
    Bound(
        "head_dim is None or (type(head_dim) is int and head_dim >= 1)",
        "head_dim must be a positive int",
        "got head_dim={head_dim!r}",
        False,
    ),
)

TOTAL_TOKENS = (
    Bind("total_tokens", "_exact_int(total_tokens)", per_call=False),
    Bound(
        "type(total_tokens) is int and total_tokens >= 0",
        "total_tokens must be a non-negative int",
        "got total_tokens={total_tokens!r}",
    ),
)

TOTAL_COMP = Bound(
    "type(total_comp) is int and total_comp >= 0",
    "total_comp must be a non-negative int",
    "got total_comp={total_comp!r}",
)

# The two offset arrays (also validate_pack's host-side part).
OFFSETS = (
    _is_tensor("cu_seqlens"),
    _rank("cu_seqlens", 1),
    *_layout("cu_seqlens", "I32", 4),
    Bind("cu_shape", "cu_seqlens.shape"),
    Bind("(offsets,)", "cu_shape"),
    Bound("offsets >= 2", "cu_seqlens must have at least 2 entries", "got shape {tuple(cu_shape)}"),
    _device("cu_seqlens"),
    _is_tensor("cu_seqlens_comp"),
    _rank("cu_seqlens_comp", 1),
    *_layout("cu_seqlens_comp", "I32", 4),
    Bound(
        "cu_seqlens_comp.shape == cu_shape",
        "cu_seqlens_comp shape must equal cu_seqlens shape",
        "got {tuple(cu_seqlens_comp.shape)} vs {tuple(cu_shape)}",
    ),
    _device("cu_seqlens_comp"),
)

PACK = (
    _is_tensor("kv"),
    Bound("kv.dtype in VALUE_DTYPES", "kv dtype must be one of {VALUE_DTYPES}", "got {kv.dtype}", False),
    _rank("kv", 2),
    Bind("kv_shape", "kv.shape"),
    Bind("T, width", "kv_shape"),
    Bound(
        "width % coff == 0", "kv.shape[1] must be coff * head_dim", "got kv.shape[1]={width} with coff={coff}", False
    ),
    _DERIVE,
    Bound("HEAD_DIM >= 1", "head_dim must be >= 1", "got head_dim={HEAD_DIM}", False),
    Bound("width == WIDTH", "kv.shape[1] must be coff * head_dim", "got {width} != {COFF} * {HEAD_DIM}"),
    *_layout("kv", "DTYPE", 16),
    _device("kv"),
    *_operand("score", 2, "DTYPE", 16, "kv_shape"),
    *_operand("ape", 2, "F32", 16, "APE_SHAPE"),
    *OFFSETS,
    Bound(
        "T * width < INT32_LIMIT", "int32 offsets need T * coff * head_dim < 2**31", "got {T} * {width} = {T * width}"
    ),
)


def _rows_operand(name):
    """``out`` (forward) or ``grad_out`` (backward): ``(total_comp, head_dim)`` rows."""
    return (
        _is_tensor(name),
        _rank(name, 2),
        Bind(f"rows, {name}_width", f"{name}.shape"),
        *_layout(name, "DTYPE", 16),
        Bound(
            f"{name}_width == HEAD_DIM",
            f"{name}.shape[1] must be head_dim={{HEAD_DIM}}",
            f"got shape {{tuple({name}.shape)}}",
        ),
        _device(name),
    )


ROWS_ARG = (Bind("total_comp", "_exact_int(total_comp)", per_call=False), TOTAL_COMP, Bind("rows", "total_comp"))

ROWS_NEED_TOKENS = Bound(
    "rows == 0 or T >= RATIO",
    "total_comp > 0 needs T >= ratio (padding rows read tokens 0..ratio-1)",
    "got total_comp={rows}, T={T}, ratio={RATIO}",
)

ROWS = (
    Bound(
        "rows * HEAD_DIM < INT32_LIMIT", "int32 offsets need total_comp * head_dim < 2**31", "got {rows} * {HEAD_DIM}"
    ),
    ROWS_NEED_TOKENS,
)

GRADS = (
    *_operand("grad_kv", 2, "DTYPE", 16, "kv_shape"),
    *_operand("grad_score", 2, "DTYPE", 16, "kv_shape"),
    *_operand("grad_ape", 2, "F32", 16, "APE_SHAPE"),
)

STATS = (
    _GIVEN,
    Bound(
        "USES_STATS",
        "softmax_stats are used only for windows of more than 16 slots (coff * ratio > 16) on backends that "
        "support them",
        "got ratio={RATIO}, coff={COFF}; pass softmax_stats=None",
    ),
    *_operand("softmax_stats", 3, "F32", 16, "(rows, 3, HEAD_DIM)"),
)

# The fused tail's buffers (its inputs' bounds are csa_compressor.tail.check_tail's): the forward's per-row
# rsqrt(mean(x*x) + eps) and the norm weight's gradient.
RSTD = (_GIVEN, *_operand("rstd", 1, "F32", 16, "(rows,)"))
GRAD_NORM_WEIGHT = (_GIVEN, *_operand("grad_norm_weight", 1, "F32", 16, "(HEAD_DIM,)"))

# The backward wrapper's optional total_comp; a grad_out that is no tensor of rank >= 1 is named by its own bounds.
TOTAL_COMP_ROWS = (
    *ROWS_ARG,
    Bound(
        "not isinstance(grad_out, Tensor) or grad_out.dim() == 0 or total_comp == grad_out.shape[0]",
        "total_comp must equal grad_out.shape[0]",
        "got {total_comp} vs {grad_out.shape[0]}",
    ),
)

# validate_pack's host-side part: the offsets on their own, on cu_seqlens' device.
OFFSETS_ALONE = (
    _is_tensor("cu_seqlens"),
    Bind("DEVICE", "cu_seqlens.device"),
    *OFFSETS,
)

_PACK_ARGS = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp")
_GRAD_ARGS = ("grad_out", "grad_kv", "grad_score", "grad_ape")
# name -> (arguments, steps). "_fresh": what the wrappers allocate themselves follows from kv, so is not read.
VARIANTS = {
    "forward": ((*_PACK_ARGS, "out"), (*SCALARS, *PACK, *_rows_operand("out"), *ROWS)),
    "forward_fresh": ((*_PACK_ARGS, "total_comp"), (*SCALARS, *PACK, *ROWS_ARG, *ROWS)),
    "backward": ((*_PACK_ARGS, *_GRAD_ARGS), (*SCALARS, *PACK, *_rows_operand("grad_out"), *ROWS, *GRADS)),
    "backward_fresh": ((*_PACK_ARGS, "grad_out"), (*SCALARS, *PACK, *_rows_operand("grad_out"), *ROWS)),
    "stats": (("softmax_stats", "rows"), STATS),
    "rstd": (("rstd", "rows"), RSTD),
    "grad_norm_weight": (("grad_norm_weight", "rows"), GRAD_NORM_WEIGHT),
}
_PACK_VARIANTS = ("forward", "forward_fresh", "backward", "backward_fresh")
_PER_CALL_ERRORS = (AttributeError, TypeError, ValueError)  # not tensors, wrong ranks (shape unpacking)


# ---------------------------------------------------------------- generation


def fail_bound(bound: Bound, env: dict):
    """Raise the error of ``bound``, its texts evaluated over ``env`` (the failing check's names)."""
    _fail(*(eval(compile("f" + repr(text), "<bound>", "eval"), _NAMESPACE, env) for text in (bound.bound, bound.found)))


def _full_source(name: str, params: str, steps, returns: str, bound_names: dict) -> str:
    lines = [f"def {name}({params}):"]
    for step in steps:
        if step is _DERIVE:
            lines.append(
                "    cfg = Config(ratio, coff, width // coff if head_dim is None else head_dim, kv.dtype, kv.device)"
            )
        if step in (_DERIVE, _GIVEN):
            lines.append(f"    {_CONSTANTS} = cfg.constants")
        elif isinstance(step, Bind):
            lines.append(f"    {step.names} = {step.expr}")
        else:
            lines.append(f"    if not ({step.test}):\n        _raise({bound_names[step]}, locals())")
    lines.append(f"    return {returns}")
    return "\n".join(lines)


def _recheck_source(name: str, args: tuple, steps, device_type: str) -> str:
    """``make_<name>_<device_type>(cfg)``: the recheck closure over ``cfg``'s constants; returns ``rows`` when every
    per-call bound holds, else hands the arguments to the full check (``_recheck_failed``)."""
    binds = [f"            {s.names} = {s.expr}" for s in steps if isinstance(s, Bind) and s.per_call]
    tests = [f"({s.test})" for s in steps if isinstance(s, Bound) and s.per_call]
    if device_type in _DEVICE_TESTS:
        tests = [_DEVICE_TEST.sub(_DEVICE_TESTS[device_type], test) for test in tests]
    arglist = ", ".join(args)
    return "\n".join(
        [
            f"def make_{name}_{device_type}(cfg):",
            f"    {_CONSTANTS} = cfg.constants",
            f"    def recheck_{name}({arglist}):",
            "        try:",
            *binds,
            "            if (\n                " + "\n                and ".join(tests) + "\n            ):",
            "                return rows",
            "        except _PER_CALL_ERRORS:",
            "            pass",
            f"        return _recheck_failed(cfg, {name!r}, recheck_{name}, ({arglist},))",
            f"    return recheck_{name}",
        ]
    )


def _generate():
    """Compile the full checks and the recheck factories of every variant, and the scalar checks."""
    bound_names: dict[Bound, str] = {}
    for _, steps in VARIANTS.values():
        for step in (*steps, *SCALARS, *TOTAL_COMP_ROWS, *TOTAL_TOKENS, *OFFSETS_ALONE):
            if isinstance(step, Bound) and step not in bound_names:
                bound_names[step] = f"_bound{len(bound_names)}"
                _NAMESPACE[bound_names[step]] = step
    sources = [
        _full_source("check_config", "ratio, coff, head_dim=None", SCALARS, "ratio, coff, head_dim", bound_names),
        _full_source("check_total_comp", "total_comp", ROWS_ARG, "total_comp", bound_names),
        _full_source("check_rows_need_tokens", "rows, T, RATIO", (ROWS_NEED_TOKENS,), "None", bound_names),
        _full_source("check_total_tokens", "total_tokens", TOTAL_TOKENS, "total_tokens", bound_names),
        _full_source("check_offsets", "cu_seqlens, cu_seqlens_comp", OFFSETS_ALONE, "None", bound_names),
        _full_source("check_total_comp_rows", "total_comp, grad_out", TOTAL_COMP_ROWS, "total_comp", bound_names),
    ]
    device_types = (*_DEVICE_TESTS, "other")
    for name, (args, steps) in VARIANTS.items():
        params = ", ".join((*args, "ratio", "coff", "head_dim", "cfg"))
        sources.append(_full_source(f"full_{name}", params, steps, f"cfg, ({', '.join(args)},)", bound_names))
        sources.extend(_recheck_source(name, args, steps, device_type) for device_type in device_types)
    exec(compile("\n\n".join(sources), "<csa_compressor.support bounds>", "exec"), _NAMESPACE)
    full = {name: _NAMESPACE[f"full_{name}"] for name in VARIANTS}
    factories = {kind: {name: _NAMESPACE[f"make_{name}_{kind}"] for name in VARIANTS} for kind in device_types}
    return full, factories


def _recheck_failed(cfg: Config, name: str, recheck, args: tuple):
    """A recheck failed: the full check names the first bound broken (ValueError). If none is, the call's scalars
    needed converting (``numpy`` integers: the recheck then runs again on ints) or its configuration differs."""
    got, normalized = _FULL[name](*args, cfg.ratio, cfg.coff, None, cfg)
    if got == cfg and any(a is not b for a, b in zip(args, normalized, strict=True)):
        return recheck(*normalized)
    kv = args[0]
    call = f"got kv {tuple(kv.shape)} {kv.dtype} on {kv.device}" if name in _PACK_VARIANTS else f"got {args}"
    _fail(
        "execute() tensors must match the configuration compiled for",
        f"compiled for head_dim={cfg.head_dim}, coff={cfg.coff}, {cfg.dtype} on {cfg.device}; {call}",
    )


_NAMESPACE: dict = {
    "Tensor": torch.Tensor,
    "Config": Config,
    "INT32_LIMIT": INT32_LIMIT,
    "MAX_RATIO": MAX_RATIO,
    "VALUE_DTYPES": VALUE_DTYPES,
    "F32": F32,
    "I32": I32,
    "_exact_int": _exact_int,
    "_raise": fail_bound,
    "_recheck_failed": _recheck_failed,
    "_PER_CALL_ERRORS": _PER_CALL_ERRORS,
}
_FULL, _RECHECK_FACTORIES = _generate()
check_config = _NAMESPACE["check_config"]
check_config.__doc__ = "``(ratio, coff, head_dim)`` as ints (exact conversion), or ValueError naming the bound."
check_total_comp = _NAMESPACE["check_total_comp"]
check_total_comp.__doc__ = "``total_comp`` as an int (exact conversion), or ValueError naming the bound."
check_rows_need_tokens = _NAMESPACE["check_rows_need_tokens"]
check_rows_need_tokens.__doc__ = "The eager reference's own guard: ``rows > 0`` needs ``T >= ratio``."
check_total_tokens = _NAMESPACE["check_total_tokens"]
check_total_tokens.__doc__ = "``total_tokens`` (validate_pack's T) as an int, or ValueError naming the bound."
check_offsets = _NAMESPACE["check_offsets"]
check_offsets.__doc__ = (
    "The offset arrays' own bounds (tensors, int32, 1-D, at least 2 entries, one shape, one device)."
)
check_total_comp_rows = _NAMESPACE["check_total_comp_rows"]
check_total_comp_rows.__doc__ = "The backward wrapper's ``total_comp``: an int equal to ``grad_out.shape[0]``."


def check_backward_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *, ratio, coff, head_dim=None):
    """The backward wrappers' bounds (the gradients are theirs to allocate); returns the configuration."""
    return _FULL["backward_fresh"](kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, None)[
        0
    ]


def check_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, *, ratio, coff, head_dim=None) -> Config:
    """Every forward bound (``check_support``); returns the configuration, scalars converted to ints."""
    return _FULL["forward"](kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, head_dim, None)[0]


def check_forward_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff, head_dim=None):
    """The forward wrappers' bounds (no ``out`` yet: ``total_comp`` instead); returns the configuration."""
    return _FULL["forward_fresh"](kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff, head_dim, None)[
        0
    ]


def check_backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, *, ratio, coff, head_dim=None
) -> Config:
    """Every backward bound (``check_support``); returns the configuration, scalars converted to ints."""
    args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
    return _FULL["backward"](*args, ratio, coff, head_dim, None)[0]


# ---------------------------------------------------------------- the validation mode's switch

VALIDATE_ENV_VAR = "CSA_COMPRESSOR_VALIDATE"


def raw_env_reader(name: str):
    """A function returning ``$name``'s raw value (None when unset), cheap enough for every call."""
    # os.environ.get encodes the key and decodes the value on every call, a cost on the per-call path;
    # CPython's os.environ keeps the encoded pairs in ``_data``, which every write through os.environ
    # (monkeypatch.setenv included) updates. Writes that bypass os.environ (os.putenv) are not seen by
    # os.environ.get either.
    data, encodekey = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encodekey is not None:
        return functools.partial(data.get, encodekey(name))
    return functools.partial(os.environ.get, name)


validation_env = raw_env_reader(VALIDATE_ENV_VAR)
validation_env.__doc__ = f"The raw value of ${VALIDATE_ENV_VAR} (None when unset), cheap enough for every call."


def validation_requested(validate) -> bool:
    """Whether a call validates its offsets: ``validate`` true, or ``$CSA_COMPRESSOR_VALIDATE`` set to 1."""
    if validate:
        return True
    value = os.environ.get(VALIDATE_ENV_VAR, "")
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"csa_compressor: {VALIDATE_ENV_VAR} must be 0 or 1 (or unset): got {value!r}")
