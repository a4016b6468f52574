"""Public kernel API: check_support / compile / execute classes and allocating wrappers (SPEC section 4)."""

from __future__ import annotations

import contextlib

import torch

from . import dispatch, support, thd
from .support import Config
from .windows import uses_softmax_stats

__all__ = [
    "CSACompressorBackward",
    "CSACompressorForward",
    "TupleDict",
    "csa_compressor_backward_wrapper",
    "csa_compressor_forward_wrapper",
]


class TupleDict(dict):
    """A dict of results that also unpacks, iterates and indexes like a tuple of its values.

    ``out, = fwd(...)``, ``fwd(...)["out"]``, ``fwd(...)[0]`` and ``bwd(...)[:2]`` all work.
    ``keys()`` / ``items()`` behave as for a dict.
    """

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return tuple(self.values())[key]
        return super().__getitem__(key)


# Configurations whose kernels were built: (backend, direction, Config). A first build
# under CUDA-graph capture is refused here, whatever the backend.
_COMPILED: set[tuple[str, str, Config]] = set()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Op:
    direction = ""

    def __init__(self, samples, ratio, coff, head_dim, backend):
        self._samples = samples
        self.ratio = ratio
        self.coff = coff
        self.head_dim = head_dim
        self.requested_backend = backend
        self.backend: str | None = None
        self.config: Config | None = None
        self._module = None
        # Per-call fast path, bound by compile(): the backend's launch function, the scalars it takes and the
        # configuration's generated rechecks (support.Config).
        self._launch = self._recheck = self._recheck_fresh = None
        self._ratio = self._coff = self._head_dim = 0
        # Long windows: the forward can save softmax statistics that the backward then uses (reference.py).
        self.uses_stats = False

    def _check(self) -> Config:
        raise NotImplementedError

    def check_support(self) -> bool:
        """Validate the samples against every bound; ValueError (shapes, dtypes, bounds) or RuntimeError (device)."""
        if self.config is None:
            if self._samples is None:
                raise RuntimeError("csa_compressor: check_support() needs the sample tensors, which were released")
            cfg = self._check()
            name = dispatch.resolve_backend(self.requested_backend, cfg.device, cfg.ratio, cfg.coff, cfg.head_dim)
            self.config, self.backend, self._module = cfg, name, dispatch.backend_module(name)
            # The scalars as the checks converted them (numpy integers become ints).
            self.ratio, self.coff, self.head_dim = cfg.ratio, cfg.coff, cfg.head_dim
            self.uses_stats = uses_softmax_stats(cfg.ratio, cfg.coff)
            supports = getattr(self._module, "supports_stats", None)
            if self.uses_stats and (supports is None or not supports(cfg.ratio, cfg.coff, cfg.head_dim)):
                raise RuntimeError(f"csa_compressor: backend {name!r} has no softmax-statistics path for {cfg}")
        return True

    def compile(self) -> None:
        """Build the kernels for this configuration, so that later calls (and graph capture) never compile."""
        self.check_support()
        key = (self.backend, self.direction, self.config)
        cfg = self.config
        if key not in _COMPILED:
            if _capturing(cfg.device):
                raise RuntimeError(
                    f"csa_compressor: the {self.backend} {self.direction} kernel for ratio={cfg.ratio}, "
                    f"coff={cfg.coff}, head_dim={cfg.head_dim} would be compiled during CUDA-graph capture; "
                    "call compile() (or run the op once) before capturing"
                )
            if cfg.device.type != "meta":
                self._module.compile(self.direction, cfg.ratio, cfg.coff, cfg.head_dim, cfg.dtype, cfg.device)
                _COMPILED.add(key)
        # From here on execute() goes straight to the backend: nothing it does can compile.
        self._ratio, self._coff, self._head_dim = cfg.ratio, cfg.coff, cfg.head_dim
        self._recheck = getattr(cfg, f"recheck_{self.direction}")
        self._recheck_fresh = getattr(cfg, f"recheck_{self.direction}_fresh")
        self._launch = getattr(self._module, self.direction)

    def _release_samples(self) -> None:
        self._samples = None

    def _validate(self, kv, cu_seqlens, cu_seqlens_comp, rows: int, stream, validate) -> None:
        """The validation mode: the offsets' contents on the device (thd.validate_pack), one synchronisation."""
        if support.validation_requested(validate):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                thd.validate_pack(cu_seqlens, cu_seqlens_comp, self._ratio, kv.shape[0], rows)


def _keep_alive(stream, tensors) -> None:
    # The caller may free its tensors before the kernel on `stream` has run; record the use.
    if stream != torch.cuda.current_stream(stream.device):
        for t in tensors:
            if t is not None and t.device.type == "cuda":
                t.record_stream(stream)


class CSACompressorForward(_Op):
    """Forward pooling. ``execute`` writes ``out`` ``(total_comp, head_dim)``."""

    direction = "forward"

    def __init__(
        self,
        sample_kv,
        sample_score,
        sample_ape,
        sample_cu_seqlens,
        sample_cu_seqlens_comp,
        sample_out,
        ratio: int = 4,
        coff: int = 2,
        head_dim: int | None = None,
        backend: str | None = "auto",
    ):
        samples = (sample_kv, sample_score, sample_ape, sample_cu_seqlens, sample_cu_seqlens_comp, sample_out)
        super().__init__(samples, ratio, coff, head_dim, backend)

    def _check(self) -> Config:
        return support.check_forward(*self._samples, ratio=self.ratio, coff=self.coff, head_dim=self.head_dim)

    def execute(
        self, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream=None, softmax_stats=None, validate=False
    ):
        """Write ``out``; with ``softmax_stats`` (a ``(total_comp, 3, head_dim)`` float32 buffer, long windows
        only: ``uses_stats``) also the softmax statistics that ``CSACompressorBackward.execute`` can take.

        ``validate=True`` (or ``CSA_COMPRESSOR_VALIDATE=1``): check the offsets' contents first (one host
        synchronisation; refused under CUDA-graph capture), see ``validate_pack``.
        """
        # Hot path: one attribute test, the attribute-only recheck and the backend call.
        launch = self._launch
        if launch is None:
            self.compile()
            launch = self._launch
        rows = self._recheck(kv, score, ape, cu_seqlens, cu_seqlens_comp, out)
        if softmax_stats is not None:
            self.config.recheck_stats(softmax_stats, rows)
        if validate or _validation_env() is not None:
            self._validate(kv, cu_seqlens, cu_seqlens_comp, rows, stream, validate)
        if rows == 0:
            return out
        if stream is not None:
            _keep_alive(stream, (kv, score, ape, cu_seqlens, cu_seqlens_comp, out, softmax_stats))
        launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, self._ratio, self._coff, stream, softmax_stats)
        return out

    def _run_fresh(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, stream, validate=False):
        """``execute`` of a compiled op for the wrappers: recheck with ``total_comp`` (before anything is
        allocated), allocate ``out``, launch."""
        rows = self._recheck_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp)
        if validate or _validation_env() is not None:
            self._validate(kv, cu_seqlens, cu_seqlens_comp, rows, stream, validate)
        # Allocated on the current stream; with an explicit `stream`, the use is recorded there.
        out = kv.new_empty((rows, self._head_dim))
        if rows:
            if stream is not None:
                _keep_alive(stream, (kv, score, ape, cu_seqlens, cu_seqlens_comp, out))
            self._launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, self._ratio, self._coff, stream, None)
        return out

    def _run_fresh_stats(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, stream, validate=False):
        """``_run_fresh`` that also allocates and fills the softmax statistics: ``(out, softmax_stats)``."""
        rows = self._recheck_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp)
        stats = torch.empty((rows, 3, self._head_dim), dtype=torch.float32, device=kv.device)
        self.config.recheck_stats(stats, rows)  # long windows only: names the bound otherwise
        if validate or _validation_env() is not None:
            self._validate(kv, cu_seqlens, cu_seqlens_comp, rows, stream, validate)
        out = kv.new_empty((rows, self._head_dim))
        if rows:
            if stream is not None:
                _keep_alive(stream, (kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats))
            self._launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, self._ratio, self._coff, stream, stats)
        return out, stats


class CSACompressorBackward(_Op):
    """Backward pooling. ``execute`` overwrites ``grad_kv``, ``grad_score`` (exact zeros where unconsumed) and ``grad_ape``."""

    direction = "backward"

    def __init__(
        self,
        sample_kv,
        sample_score,
        sample_ape,
        sample_cu_seqlens,
        sample_cu_seqlens_comp,
        sample_grad_out,
        sample_grad_kv,
        sample_grad_score,
        sample_grad_ape,
        ratio: int = 4,
        coff: int = 2,
        head_dim: int | None = None,
        backend: str | None = "auto",
    ):
        samples = (
            sample_kv,
            sample_score,
            sample_ape,
            sample_cu_seqlens,
            sample_cu_seqlens_comp,
            sample_grad_out,
            sample_grad_kv,
            sample_grad_score,
            sample_grad_ape,
        )
        super().__init__(samples, ratio, coff, head_dim, backend)

    def _check(self) -> Config:
        return support.check_backward(*self._samples, ratio=self.ratio, coff=self.coff, head_dim=self.head_dim)

    def execute(
        self,
        kv,
        score,
        ape,
        cu_seqlens,
        cu_seqlens_comp,
        grad_out,
        grad_kv,
        grad_score,
        grad_ape,
        stream=None,
        softmax_stats=None,
        validate=False,
    ):
        """Overwrite the three gradients. ``softmax_stats``: what ``CSACompressorForward.execute`` saved for these
        inputs (long windows); the kernel then skips its own pass over the window for the row statistics.
        ``validate``: as for the forward."""
        if self._launch is None:
            self.compile()
        rows = self._recheck(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
        grads = grad_kv, grad_score, grad_ape
        if rows == 0 or softmax_stats is not None or validate or stream is not None or _validation_env() is not None:
            return self._launch_rows(
                kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grads, rows, stream, softmax_stats, validate
            )
        self._launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, self._ratio, self._coff, None, None)
        return grads

    def _run_fresh(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, stream, stats=None, validate=False):
        """``execute`` of a compiled op for the wrappers, which allocate the gradients (``torch.empty_like``)."""
        rows = self._recheck_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out)
        # The kernel writes every element: uninitialised buffers, one allocation each.
        grads = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
        if rows == 0 or stats is not None or validate or stream is not None or _validation_env() is not None:
            return self._launch_rows(
                kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grads, rows, stream, stats, validate
            )
        self._launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, self._ratio, self._coff, None, None)
        return grads

    def _launch_rows(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grads, rows, stream, stats, validate):
        """The rarer part of both paths (no rows, statistics, validation, an explicit stream), then the kernel."""
        grad_kv, grad_score, grad_ape = grads
        if stats is not None:
            self.config.recheck_stats(stats, rows)
        if validate or _validation_env() is not None:
            self._validate(kv, cu_seqlens, cu_seqlens_comp, rows, stream, validate)
        if rows == 0:
            # Nothing consumed anything: the gradients are exact zeros.
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                grad_kv.zero_()
                grad_score.zero_()
                grad_ape.zero_()
            return grads
        if stream is not None:
            _keep_alive(stream, (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, stats))
        self._launch(
            kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, self._ratio, self._coff,
            stream, stats,
        )  # fmt: skip
        return grads


_validation_env = support.validation_env

# ---------------------------------------------------------------- wrappers


def _rows_on_device(cu_seqlens_comp) -> int:
    # Convenience path: one host synchronisation. Pass total_comp to avoid it (CUDA graphs must).
    return int(cu_seqlens_comp[-1].item())


# Wrapper ops, compiled on the first call of a configuration (samples dropped after compile, so the cache
# holds no device memory). Two levels:
# - _OPS: the full key (direction, ratio, coff, head_dim, dtype, device, resolved backend request);
# - _FWD_FAST / _BWD_FAST: the wrapper's raw arguments (ratio, coff, head_dim or None, kv width, backend
#   argument, raw $CSA_COMPRESSOR_BACKEND, dtype, device) -> op, filled after a successful slow call. A hit
#   skips argument normalisation; the op's recheck still tests every argument against its configuration.
_OPS: dict[tuple, _Op] = {}
_FWD_FAST: dict[tuple, _Op] = {}
_BWD_FAST: dict[tuple, _Op] = {}
_env_token = dispatch.env_token


def _op(cls, direction: str, tensors, ratio, coff, head_dim, backend) -> _Op:
    backend = dispatch.requested_backend(backend)
    key = (direction, ratio, coff, head_dim, tensors[0].dtype, tensors[0].device, backend)
    op = _OPS.get(key)
    if op is None:
        op = cls(*tensors, ratio=ratio, coff=coff, head_dim=head_dim, backend=backend)
        op.compile()
        op._release_samples()
        _OPS[key] = op
    return op


def _fast_key(kv, ratio, coff, head_dim, backend):
    """The fast-cache key of a wrapper call, or None when an argument needs the full (validating) path."""
    if type(ratio) is not int or type(coff) is not int or not (head_dim is None or type(head_dim) is int):
        return None  # 4.0 == 4 and True == 1 as dict keys: floats and bools must reach check_config
    try:
        return (ratio, coff, head_dim, kv.shape[-1], backend, _env_token(), kv.dtype, kv.device)
    except (AttributeError, IndexError, TypeError):  # not a tensor, rank 0, unhashable backend
        return None


def _forward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, backend, key) -> _Op:
    """The forward wrapper's slow path: the scalars and tensors checked (the first broken bound named), the op
    built and cached. ``total_comp`` is the op's recheck's business."""
    ratio, coff, head_dim = support.check_config(ratio, coff, head_dim)
    pack = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    head_dim = support.check_forward_fresh(*pack, 0, ratio=ratio, coff=coff, head_dim=head_dim).head_dim
    op = _op(CSACompressorForward, "forward", (*pack, kv.new_empty((0, head_dim))), ratio, coff, head_dim, backend)
    if key is not None:
        _FWD_FAST[key] = op
    return op


def _backward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, backend, key) -> _Op:
    """The backward wrapper's slow path (see ``_forward_op``)."""
    ratio, coff, head_dim = support.check_config(ratio, coff, head_dim)
    pack = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out)
    head_dim = support.check_backward_fresh(*pack, ratio=ratio, coff=coff, head_dim=head_dim).head_dim
    grads = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    op = _op(CSACompressorBackward, "backward", (*pack, *grads), ratio, coff, head_dim, backend)
    if key is not None:
        _BWD_FAST[key] = op
    return op


_AUTOGRAD_STATS: dict[tuple, bool] = {}


def autograd_uses_stats(kv, ratio, coff, backend) -> bool:
    """Whether the autograd function saves the forward's softmax statistics for this call's backend.

    Long windows only (``windows.uses_softmax_stats``), and only on backends whose statistics pair is
    validated at full size on the GPU (their ``AUTOGRAD_STATS``); elsewhere the backward makes its own
    statistics. Cached per (device, backend request, configuration, $CSA_COMPRESSOR_BACKEND).
    """
    if type(ratio) is not int or type(coff) is not int or not uses_softmax_stats(ratio, coff):
        return False
    return _autograd_stats_for(kv.device, backend, ratio, coff, int(kv.shape[-1]))


def _autograd_stats_for(device, backend, ratio: int, coff: int, width: int) -> bool:
    key = (device, backend, ratio, coff, width, _env_token())
    hit = _AUTOGRAD_STATS.get(key)
    if hit is None:
        try:
            name = dispatch.resolve_backend(backend, device, ratio, coff, width // coff)
        except (ValueError, RuntimeError):
            return False  # the forward call reports the problem
        hit = bool(getattr(dispatch.backend_module(name), "AUTOGRAD_STATS", False))
        _AUTOGRAD_STATS[key] = hit
    return hit


# Under torch.compile the lookup is evaluated once while tracing and is a constant after: what
# torch.compiler.assume_constant_result does, without its import of torch._dynamo here, which would import
# triton before the self-check can select its interpreter (tests/test_stats.py checks that the two agree).
_autograd_stats_for._dynamo_marked_constant = True


def _pool_forward(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    ratio,
    coff,
    total_comp,
    backend,
    head_dim=None,
    stream=None,
    return_stats=False,
    validate=False,
):
    """The forward wrapper without the TupleDict: returns ``out`` (also the autograd op's eager path), or
    ``(out, softmax_stats)`` with ``return_stats`` (long windows only)."""
    key = _fast_key(kv, ratio, coff, head_dim, backend)
    op = _FWD_FAST.get(key) if key is not None else None
    if op is None:  # first call of this configuration, or arguments that need normalising
        op = _forward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, backend, key)
    if total_comp is None:
        total_comp = _rows_on_device(cu_seqlens_comp)
    if return_stats:
        return op._run_fresh_stats(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, stream, validate)
    return op._run_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, stream, validate)


def _pool_backward(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    ratio,
    coff,
    backend,
    head_dim=None,
    stream=None,
    stats=None,
    validate=False,
):
    """The backward wrapper without the TupleDict: returns ``(grad_kv, grad_score, grad_ape)``."""
    key = _fast_key(kv, ratio, coff, head_dim, backend)
    op = _BWD_FAST.get(key) if key is not None else None
    if op is None:
        op = _backward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, backend, key)
    return op._run_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, stream, stats, validate)


def csa_compressor_forward_wrapper(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    ratio: int = 4,
    head_dim: int | None = None,
    coff: int = 2,
    total_comp: int | None = None,
    stream=None,
    backend: str | None = "auto",
    return_softmax_stats: bool = False,
    validate: bool = False,
) -> TupleDict:
    """Allocate ``out`` and run the forward. ``total_comp=None`` reads ``cu_seqlens_comp[-1]`` (one host sync).

    ``return_softmax_stats=True`` (windows of more than 16 slots): also ``softmax_stats``, the
    ``(total_comp, 3, head_dim)`` float32 statistics the backward wrapper takes to skip a pass over the window.
    ``validate=True`` (or ``CSA_COMPRESSOR_VALIDATE=1``): check the offsets' contents on the device first (one
    host synchronisation; refused under CUDA-graph capture), see ``validate_pack``.
    """
    if return_softmax_stats:
        out, stats = _pool_forward(
            kv,
            score,
            ape,
            cu_seqlens,
            cu_seqlens_comp,
            ratio,
            coff,
            total_comp,
            backend,
            head_dim,
            stream,
            True,
            validate,
        )
        return TupleDict(out=out, softmax_stats=stats)
    out = _pool_forward(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, head_dim, stream, False, validate
    )
    return TupleDict(out=out)


def csa_compressor_backward_wrapper(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    ratio: int = 4,
    head_dim: int | None = None,
    coff: int = 2,
    total_comp: int | None = None,
    stream=None,
    backend: str | None = "auto",
    softmax_stats=None,
    validate: bool = False,
) -> TupleDict:
    """Allocate and compute ``grad_kv``, ``grad_score`` (``empty``: the kernel writes every element) and ``grad_ape``.

    ``softmax_stats``: the forward wrapper's ``softmax_stats`` for the same inputs (long windows), or None.
    ``validate``: as for the forward wrapper.
    """
    if total_comp is not None:
        support.check_total_comp_rows(total_comp, grad_out)
    grad_kv, grad_score, grad_ape = _pool_backward(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, backend, head_dim, stream, softmax_stats,
        validate,
    )  # fmt: skip
    return TupleDict(grad_kv=grad_kv, grad_score=grad_score, grad_ape=grad_ape)
