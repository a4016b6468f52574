"""The kernel API's classes: check_support / compile / execute (SPEC section 4), with the optional fused tail.

``csa_compressor.api`` exports them beside the allocating wrappers, which run the same ops.
"""

from __future__ import annotations

import contextlib

import torch

from . import dispatch, support, thd
from . import tail as tails
from .support import Config
from .tail_args import TailCheck, is_default_tail, tail_backend, tail_config
from .windows import uses_softmax_stats

__all__ = ["CSACompressorBackward", "CSACompressorForward", "TupleDict"]


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


# Configurations whose kernels were built: (backend, direction, Config, TailConfig or None). A first build
# under CUDA-graph capture is refused here, whatever the backend.
_COMPILED: set[tuple] = set()
_validation_env = support.validation_env


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _tail_tensors(tail) -> tuple:
    return () if tail is None else (tail.norm_weight, tail.rope_cos, tail.rope_sin, tail.position_start)


class _Op:
    direction = ""

    def __init__(self, samples, ratio, coff, head_dim, backend, tail: tails.Tail):
        self._samples = samples
        self._tail_sample = tail
        self.ratio = ratio
        self.coff = coff
        self.head_dim = head_dim
        self.requested_backend = backend
        self.backend: str | None = None
        self.config: Config | None = None
        # The fused tail's configuration (None: the pooling alone), fixed by the samples like the rest.
        self.tail_config: tails.TailConfig | None = None
        self._module = None
        # Per-call fast path, bound by compile(): the backend's launch function, the scalars it takes and the
        # configuration's generated rechecks (support.Config; tail_args.TailCheck's, which returns the Tail).
        self._launch = self._recheck = self._recheck_fresh = self._tail_check = None
        self._ratio = self._coff = self._head_dim = 0
        # Long windows: the forward can save softmax statistics that the backward then uses (reference.py).
        self.uses_stats = False

    def _check(self) -> Config:
        raise NotImplementedError

    def check_support(self) -> bool:
        """Validate the samples against every bound; ValueError (shapes, dtypes, bounds, a tail on a backend
        without one) or RuntimeError (device)."""
        if self.config is None:
            if self._samples is None:
                raise RuntimeError("csa_compressor: check_support() needs the sample tensors, which were released")
            cfg = self._check()
            name = dispatch.resolve_backend(self.requested_backend, cfg.device, cfg.ratio, cfg.coff, cfg.head_dim)
            batch = self._samples[3].shape[0] - 1  # cu_seqlens has passed the checks
            tail_cfg = tail_config(self._tail_sample, head_dim=cfg.head_dim, batch=batch, device=cfg.device)
            if tail_cfg is not None:
                scalars = (cfg.device, cfg.ratio, cfg.coff, cfg.head_dim, tail_cfg)
                name = tail_backend(self.requested_backend, name, *scalars)
            self.config, self.backend, self._module = cfg, name, dispatch.backend_module(name)
            self.tail_config = tail_cfg
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
        cfg, tail_cfg = self.config, self.tail_config
        key = (self.backend, self.direction, cfg, tail_cfg)
        scalars = (self.direction, cfg.ratio, cfg.coff, cfg.head_dim, cfg.dtype, cfg.device)
        if key not in _COMPILED:
            if _capturing(cfg.device):
                raise RuntimeError(
                    f"csa_compressor: the {self.backend} {self.direction} kernel for ratio={cfg.ratio}, "
                    f"coff={cfg.coff}, head_dim={cfg.head_dim} would be compiled during CUDA-graph capture; "
                    "call compile() (or run the op once) before capturing"
                )
            if cfg.device.type != "meta":
                if tail_cfg is None:
                    self._module.compile(*scalars)
                else:
                    self._module.compile(*scalars, tail_config=tail_cfg)
                _COMPILED.add(key)
        # From here on execute() goes straight to the backend: nothing it does can compile.
        self._ratio, self._coff, self._head_dim = cfg.ratio, cfg.coff, cfg.head_dim
        self._recheck = getattr(cfg, f"recheck_{self.direction}")
        self._recheck_fresh = getattr(cfg, f"recheck_{self.direction}_fresh")
        self._tail_check = TailCheck(tail_cfg, cfg.head_dim, cfg.device).recheck
        # A backend may bind its function to the configuration (the backends' optional ``bind``).
        bind = getattr(self._module, "bind", None)
        self._launch = getattr(self._module, self.direction) if bind is None else bind(*scalars, tail_cfg)

    def _release_samples(self) -> None:
        self._samples = self._tail_sample = None

    def _validate(self, kv, cu_seqlens, cu_seqlens_comp, rows: int, stream, validate, tail=None) -> None:
        """The validation mode: the offsets' contents on the device (thd.validate_pack) and, with a rotary tail,
        the rows' positions (tail.validate_positions); one synchronisation each."""
        if support.validation_requested(validate):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                thd.validate_pack(cu_seqlens, cu_seqlens_comp, self._ratio, kv.shape[0], rows)
                if tail is not None:
                    tails.validate_positions(tail, cu_seqlens_comp, self._ratio)

    def _checked_rstd(self, rstd, rows: int, tail) -> None:
        if rstd is not None:
            if tail is None:
                raise ValueError("csa_compressor: rstd needs a tail (norm_weight or rope_dim > 0): got no tail")
            self.config.recheck_rstd(rstd, rows)


def _keep_alive(stream, tensors) -> None:
    # The caller may free its tensors before the kernel on `stream` has run; record the use.
    if stream != torch.cuda.current_stream(stream.device):
        for t in tensors:
            if t is not None and t.device.type == "cuda":
                t.record_stream(stream)


def _tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start) -> tails.Tail:
    return tails.Tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)


class CSACompressorForward(_Op):
    """Forward pooling and its optional fused tail. ``execute`` writes ``out`` ``(total_comp, head_dim)``."""

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
        norm_weight=None,
        norm_eps: float = 1e-6,
        rope_cos=None,
        rope_sin=None,
        rope_dim: int = 0,
        rope_interleaved: bool = True,
        position_start=None,
    ):
        samples = (sample_kv, sample_score, sample_ape, sample_cu_seqlens, sample_cu_seqlens_comp, sample_out)
        tail = _tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
        super().__init__(samples, ratio, coff, head_dim, backend, tail)

    def _check(self) -> Config:
        return support.check_forward(*self._samples, ratio=self.ratio, coff=self.coff, head_dim=self.head_dim)

    def execute(
        self,
        kv,
        score,
        ape,
        cu_seqlens,
        cu_seqlens_comp,
        out,
        stream=None,
        softmax_stats=None,
        validate=False,
        norm_weight=None,
        norm_eps=1e-6,
        rope_cos=None,
        rope_sin=None,
        rope_dim=0,
        rope_interleaved=True,
        position_start=None,
        rstd=None,
    ):
        """Write ``out``; with ``softmax_stats`` (a ``(total_comp, 3, head_dim)`` float32 buffer, long windows
        only: ``uses_stats``) also the softmax statistics that ``CSACompressorBackward.execute`` can take.

        The tail arguments (docs/tail.md) must match the samples' configuration; ``rstd``: a ``(total_comp,)``
        float32 buffer to fill with each row's ``rsqrt(mean(x*x) + eps)`` (with a tail only).
        ``validate=True`` (or ``CSA_COMPRESSOR_VALIDATE=1``): check the offsets' contents (and the rows'
        positions) first (one host synchronisation; refused under CUDA-graph capture), see ``validate_pack``.
        """
        # Hot path: one attribute test, the attribute-only recheck, the no-tail test and the backend call.
        launch = self._launch
        if launch is None:
            self.compile()
            launch = self._launch
        rows = self._recheck(kv, score, ape, cu_seqlens, cu_seqlens_comp, out)
        if not (
            is_default_tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
            and rstd is None
            and self.tail_config is None
        ):
            tail_args = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
            tail = self._tail_check(cu_seqlens, *tail_args)
            if softmax_stats is not None:
                self.config.recheck_stats(softmax_stats, rows)
            self._checked_rstd(rstd, rows, tail)
            inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
            return self._launch_tail(inputs, out, rows, stream, softmax_stats, validate, tail, rstd)
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

    def _launch_tail(self, inputs, out, rows, stream, stats, validate, tail, rstd):
        """The checked tail path (``tail`` None: an identity tail, the pooling alone): validation, then the kernel."""
        if validate or _validation_env() is not None:
            self._validate(inputs[0], inputs[3], inputs[4], rows, stream, validate, tail)
        if rows == 0:
            return out
        if stream is not None:
            _keep_alive(stream, (*inputs, out, stats, rstd, *_tail_tensors(tail)))
        self._launch(*inputs, out, self._ratio, self._coff, stream, stats, tail, rstd)  # the protocol's order
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

    def _run_fresh_tail(self, inputs, total_comp, tail_args, stream, want_stats, want_rstd, validate=False):
        """The wrappers' tail path: ``(out, rstd, softmax_stats)``, each absent one None (``rstd`` needs a norm)."""
        rows = self._recheck_fresh(*inputs, total_comp)
        tail = self._tail_check(inputs[3], *tail_args)
        kv = inputs[0]
        stats = None
        if want_stats:
            stats = kv.new_empty((rows, 3, self._head_dim), dtype=torch.float32)
            self.config.recheck_stats(stats, rows)  # long windows only: names the bound otherwise
        has_norm = tail is not None and tail.norm_weight is not None
        rstd = kv.new_empty((rows,), dtype=torch.float32) if want_rstd and has_norm else None
        out = kv.new_empty((rows, self._head_dim))
        return self._launch_tail(inputs, out, rows, stream, stats, validate, tail, rstd), rstd, stats


class CSACompressorBackward(_Op):
    """Backward pooling and its optional fused tail. ``execute`` overwrites ``grad_kv``, ``grad_score`` (exact
    zeros where unconsumed), ``grad_ape`` and, with a norm, ``grad_norm_weight``."""

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
        norm_weight=None,
        norm_eps: float = 1e-6,
        rope_cos=None,
        rope_sin=None,
        rope_dim: int = 0,
        rope_interleaved: bool = True,
        position_start=None,
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
        tail = _tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
        super().__init__(samples, ratio, coff, head_dim, backend, tail)

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
        norm_weight=None,
        norm_eps=1e-6,
        rope_cos=None,
        rope_sin=None,
        rope_dim=0,
        rope_interleaved=True,
        position_start=None,
        grad_norm_weight=None,
        rstd=None,
    ):
        """Overwrite the three gradients, and with a norm ``grad_norm_weight`` (a ``(head_dim,)`` float32 buffer,
        then required, and returned fourth). ``softmax_stats``: what ``CSACompressorForward.execute`` saved for
        these inputs (long windows); the kernel then skips its own pass over the window for the row statistics.
        ``grad_out`` is the gradient of the tail's output; ``rstd``: the forward's, or None (recomputed).
        ``validate``: as for the forward."""
        if self._launch is None:
            self.compile()
        rows = self._recheck(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
        grads = grad_kv, grad_score, grad_ape
        if not (
            is_default_tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
            and grad_norm_weight is None
            and rstd is None
            and self.tail_config is None
        ):
            tail_args = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
            tail = self._tail_check(cu_seqlens, *tail_args)
            self._checked_grad_norm_weight(grad_norm_weight, rows, tail)
            self._checked_rstd(rstd, rows, tail)
            inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
            return self._launch_rows(
                inputs, grad_out, grads, rows, stream, softmax_stats, validate, tail, grad_norm_weight, rstd
            )
        if rows == 0 or softmax_stats is not None or validate or stream is not None or _validation_env() is not None:
            inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
            return self._launch_rows(inputs, grad_out, grads, rows, stream, softmax_stats, validate)
        self._launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, self._ratio, self._coff, None, None)
        return grads

    def _checked_grad_norm_weight(self, grad_norm_weight, rows: int, tail) -> None:
        if tail is not None and tail.has_norm:
            if grad_norm_weight is None:
                raise ValueError("csa_compressor: grad_norm_weight is required with norm_weight: got None")
            self.config.recheck_grad_norm_weight(grad_norm_weight, rows)
        elif grad_norm_weight is not None:
            raise ValueError("csa_compressor: grad_norm_weight needs norm_weight: got a buffer and no norm_weight")

    def _run_fresh(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, stream, stats=None, validate=False):
        """``execute`` of a compiled op for the wrappers, which allocate the gradients (``torch.empty_like``)."""
        rows = self._recheck_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out)
        # The kernel writes every element: uninitialised buffers, one allocation each.
        grads = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
        if rows == 0 or stats is not None or validate or stream is not None or _validation_env() is not None:
            inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
            return self._launch_rows(inputs, grad_out, grads, rows, stream, stats, validate)
        self._launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, self._ratio, self._coff, None, None)
        return grads

    def _run_fresh_tail(self, inputs, grad_out, tail_args, stream, stats=None, rstd=None, validate=False):
        """The wrappers' tail path: ``(grad_kv, grad_score, grad_ape, grad_norm_weight or None)``."""
        rows = self._recheck_fresh(*inputs, grad_out)
        tail = self._tail_check(inputs[3], *tail_args)
        if rstd is not None:
            self._checked_rstd(rstd, rows, tail)
        kv, score, ape = inputs[:3]
        grads = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
        grad_weight = None
        if tail is not None and tail.norm_weight is not None:
            grad_weight = kv.new_empty((self._head_dim,), dtype=torch.float32)
        result = self._launch_rows(inputs, grad_out, grads, rows, stream, stats, validate, tail, grad_weight, rstd)
        return (*result, None) if grad_weight is None else result

    def _launch_rows(
        self, inputs, grad_out, grads, rows, stream, stats, validate, tail=None, grad_weight=None, rstd=None
    ):  # fmt: skip
        """The rarer part of every path (no rows, statistics, validation, an explicit stream, a tail), then the
        kernel. ``inputs``: (kv, score, ape, cu_seqlens, cu_seqlens_comp). Returns the gradients, ``grad_weight``
        fourth where the tail has a norm."""
        kv, _score, _ape, cu_seqlens, cu_seqlens_comp = inputs
        result = grads if grad_weight is None else (*grads, grad_weight)
        if stats is not None:
            self.config.recheck_stats(stats, rows)
        if validate or _validation_env() is not None:
            self._validate(kv, cu_seqlens, cu_seqlens_comp, rows, stream, validate, tail)
        if rows == 0:
            # Nothing consumed anything: the gradients are exact zeros.
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for g in result:
                    g.zero_()
            return result
        if stream is not None:
            _keep_alive(stream, (*inputs, grad_out, *result, stats, rstd, *_tail_tensors(tail)))
        # The protocol's order, positional: the tail's three are None without a tail.
        self._launch(*inputs, grad_out, *grads, self._ratio, self._coff, stream, stats, tail, grad_weight, rstd)
        return result
