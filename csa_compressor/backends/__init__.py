"""Kernel backends.

Every backend is a package ``csa_compressor.backends.<name>`` whose ``launch``
module exposes the same five functions; ``csa_compressor.dispatch`` is the one
place that picks among them.

``unavailable_reason() -> str | None``
    Why the backend cannot be imported or used at all (missing package), else None.
``device_unsupported_reason(device: torch.device) -> str | None``
    Why it cannot run on ``device`` (CPU, architecture), else None.
``compile(direction, ratio, coff, head_dim, dtype, device) -> None``
    Build everything a later ``forward``/``backward`` call with this configuration
    needs (``direction`` is "forward" or "backward"). Takes scalars and dtypes only.
``forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream) -> None``
    Writes every row of ``out`` (``(N, d)``, N > 0). No host synchronisation.
``backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, stream) -> None``
    Writes every element of ``grad_kv``, ``grad_score`` (exact zeros where nothing
    was consumed) and ``grad_ape`` (overwritten, deterministic). N > 0.

Softmax statistics (windows of more than 16 slots, ``reference.uses_softmax_stats``): ``forward`` and
``backward`` take a trailing ``stats`` argument, None or a ``(N, 3, d)`` float32 tensor (see
``reference.softmax_stats``) that the forward fills and the backward reads instead of recomputing the
row max, sum and output. ``supports_stats(ratio, coff, head_dim) -> bool`` says where a backend honours it;
``compile`` builds the stats variants too. ``AUTOGRAD_STATS`` (bool): whether the autograd function uses
them with this backend (only where the pair has passed the full-size contract on the GPU).

The fused tail (RMSNorm, then RoPE; ``csa_compressor.tail``, docs/tail.md): optional.
``supports_tail(ratio, coff, head_dim, tail_config) -> bool`` says where a backend fuses it (``tail_config`` a
``tail.TailConfig``); a backend without the function has no tail, and the API refuses a tail on it
(``ValueError``), never computing one another way. Where it is supported:

- ``compile(..., tail_config=None)`` takes the ``TailConfig`` as a keyword; the API passes it only for a tail;
- ``forward(..., stream, stats=None, tail=None, rstd=None)``: with a ``tail.Tail``, ``out[r]`` is
  ``round_bf16(rope(rmsnorm(x)))`` of the fp32 pooled row ``x``; ``rstd``, when given, a ``(N,)`` float32 buffer
  filled with every row's ``rsqrt(mean(x*x) + eps)`` (padding rows too; 1.0 without a norm); ``stats[:, 2]``
  (long windows) still holds ``x`` itself;
- ``backward(..., stream, stats=None, tail=None, grad_norm_weight=None, rstd=None)``: ``grad_out`` is the
  gradient of the tail's output; ``grad_norm_weight`` a ``(d,)`` float32 buffer, overwritten with the weight's
  gradient summed over the real rows in a fixed order (required when the tail has a norm, else None);
  ``rstd``: the forward's, or None (then recomputed). Padding rows' ``grad_out`` is ignored as without a tail.

An identity tail (neither norm nor rope) is passed as None, so a backend sees exactly the pooling then.
``csa_compressor.tail.check_backend`` is the contract a backend's tail is held to.

Optional: ``config_unsupported_reason(ratio, coff, head_dim) -> str | None`` for
backends that cover only part of the configuration space.

Optional: ``bind(direction, ratio, coff, head_dim, dtype, device, tail_config) -> callable``, called by a
compiled op once its configuration is built: ``forward`` or ``backward`` (as ``direction`` says) for that
configuration alone, same signature and results, which the op then calls instead of the module function.

``stream`` is a ``torch.cuda.Stream`` or None (the current stream of the tensors'
device). Inputs have been validated by ``csa_compressor.support`` before a call.
"""

BACKENDS = ("cute", "triton", "reference")
