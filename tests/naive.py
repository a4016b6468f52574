"""A deliberately naive, loop-per-row fp64 transcription of SPEC section 2, sharing no window code with
csa_compressor.reference, so that the references are checked against the SPEC text.
"""

import math

import torch


def _rows(cu_seqlens, cu_seqlens_comp, total_comp, ratio):
    cs, cc = cu_seqlens.tolist(), cu_seqlens_comp.tolist()
    for r in range(total_comp):
        if r >= cc[-1]:
            yield r, 0, True, False
            continue
        b = max(i for i in range(len(cc) - 1) if cc[i] <= r < cc[i + 1])
        j = r - cc[b]
        yield r, cs[b] + j * ratio, j == 0, True


def _slots(t0, first, ratio, coff, d):
    """(token, column offset, ape row, ape column offset) per slot; token None for an empty slot."""
    slots = []
    if coff == 2:
        for s in range(ratio):
            slots.append((None if first else t0 - ratio + s, 0, s, 0))
        for s in range(ratio):
            slots.append((t0 + s, d, s, d))
    else:
        for s in range(ratio):
            slots.append((t0 + s, 0, s, 0))
    return slots


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp):
    kv, score, ape = kv.double(), score.double(), ape.double()
    d = kv.shape[1] // coff
    out = torch.zeros(total_comp, d, dtype=torch.float64)
    for r, t0, first, _ in _rows(cu_seqlens, cu_seqlens_comp, total_comp, ratio):
        for c in range(d):
            vals, logits = [], []
            for tok, col, ar, ac in _slots(t0, first, ratio, coff, d):
                if tok is None:
                    vals.append(0.0)
                    logits.append(-math.inf)
                else:
                    vals.append(float(kv[tok, col + c]))
                    logits.append(float(score[tok, col + c]) + float(ape[ar, ac + c]))
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            z = sum(e)
            out[r, c] = sum(ei / z * v for ei, v in zip(e, vals, strict=True))
    return out


def backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff):
    kv, score, ape, grad_out = kv.double(), score.double(), ape.double(), grad_out.double()
    d = kv.shape[1] // coff
    g_kv = torch.zeros_like(kv)
    g_score = torch.zeros_like(kv)
    g_ape = torch.zeros_like(ape)
    for r, t0, first, real in _rows(cu_seqlens, cu_seqlens_comp, grad_out.shape[0], ratio):
        if not real:
            continue
        for c in range(d):
            slots = [s for s in _slots(t0, first, ratio, coff, d) if s[0] is not None]
            vals = [float(kv[t, col + c]) for t, col, _, _ in slots]
            logits = [float(score[t, col + c]) + float(ape[ar, ac + c]) for t, col, ar, ac in slots]
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            p = [x / sum(e) for x in e]
            g = float(grad_out[r, c])
            dot = sum(pi * g * v for pi, v in zip(p, vals, strict=True))
            for (t, col, ar, ac), pi, v in zip(slots, p, vals, strict=True):
                g_kv[t, col + c] += g * pi
                dl = pi * (g * v - dot)
                g_score[t, col + c] += dl
                g_ape[ar, ac + c] += dl
    return g_kv, g_score, g_ape


# ---------------------------------------------------------------- the tail (issue 26), from the issue text


def _tail_row_positions(cu_seqlens_comp, total_comp, ratio, position_start):
    """(row, position, real) per output row: row j of segment b sits at position_start[b] + j * ratio."""
    cc = cu_seqlens_comp.tolist()
    starts = [0] * (len(cc) - 1) if position_start is None else position_start.tolist()
    for r in range(total_comp):
        if r >= cc[-1]:
            yield r, 0, False
            continue
        b = max(i for i in range(len(cc) - 1) if cc[i] <= r < cc[i + 1])
        yield r, starts[b] + (r - cc[b]) * ratio, True


def _pair_columns(head_dim, rope_dim, interleaved):
    """[(column a, column b)] per rotary pair i, in the block [head_dim - rope_dim, head_dim)."""
    base = head_dim - rope_dim
    if interleaved:
        return [(base + 2 * i, base + 2 * i + 1) for i in range(rope_dim // 2)]
    return [(base + i, base + rope_dim // 2 + i) for i in range(rope_dim // 2)]


def _angle(tail, pos: int, i: int) -> tuple[float, float]:
    """(cos, sin) of pair ``i`` at ``pos``; a position outside the tables is not rotated (1, 0)."""
    if not 0 <= pos < tail.rope_cos.shape[0]:
        return 1.0, 0.0
    return float(tail.rope_cos[pos, i]), float(tail.rope_sin[pos, i])


def tail_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, tail):
    """fp64: the pooled row (unrounded), RMSNorm with the weight, then the rotation of each pair."""
    x = forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)
    d = x.shape[1]
    out = torch.zeros_like(x)
    pairs = _pair_columns(d, tail.rope_dim, tail.rope_interleaved)
    for r, pos, _ in _tail_row_positions(cu_seqlens_comp, total_comp, ratio, tail.position_start):
        row = [float(v) for v in x[r]]
        if tail.norm_weight is not None:
            inv_rms = 1.0 / math.sqrt(sum(v * v for v in row) / d + tail.norm_eps)
            row = [v * inv_rms * float(w) for v, w in zip(row, tail.norm_weight.tolist(), strict=True)]
        for i, (ca, cb) in enumerate(pairs):
            cos, sin = _angle(tail, pos, i)
            a, b = row[ca], row[cb]
            row[ca], row[cb] = a * cos - b * sin, a * sin + b * cos
        out[r] = torch.tensor(row, dtype=torch.float64)
    return out


def tail_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, tail):
    """fp64 (grad_kv, grad_score, grad_ape, grad_norm_weight), by the chain rule written out per element.

    For z = rotate(y), y = w * x * s with s = (mean(x^2) + eps)^(-1/2): dL/dy is grad_out turned back by the
    angle; dL/dw_c = sum over real rows of dL/dy_c * x_c * s; dL/dx_c = s * w_c * dL/dy_c
    + x_c * (ds/dx) = s * w_c * dL/dy_c - x_c * s^3 / d * sum_k x_k * w_k * dL/dy_k. That row gradient is then
    the pooling's upstream gradient (``backward`` above).
    """
    total_comp = grad_out.shape[0]
    x = forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)
    d = x.shape[1]
    grad_x = torch.zeros(total_comp, d, dtype=torch.float64)
    grad_w = None if tail.norm_weight is None else torch.zeros(d, dtype=torch.float64)
    pairs = _pair_columns(d, tail.rope_dim, tail.rope_interleaved)
    for r, pos, real in _tail_row_positions(cu_seqlens_comp, total_comp, ratio, tail.position_start):
        if not real:
            continue
        gy = [float(v) for v in grad_out[r].double()]
        for i, (ca, cb) in enumerate(pairs):
            cos, sin = _angle(tail, pos, i)
            ga, gb = gy[ca], gy[cb]
            # Transpose of [[cos, -sin], [sin, cos]].
            gy[ca], gy[cb] = ga * cos + gb * sin, -ga * sin + gb * cos
        if tail.norm_weight is None:
            grad_x[r] = torch.tensor(gy, dtype=torch.float64)
            continue
        xr = [float(v) for v in x[r]]
        w = [float(v) for v in tail.norm_weight.double()]
        s = (sum(v * v for v in xr) / d + tail.norm_eps) ** -0.5
        dot = sum(xr[k] * w[k] * gy[k] for k in range(d))
        for c in range(d):
            grad_w[c] += gy[c] * xr[c] * s
            grad_x[r, c] = s * w[c] * gy[c] - xr[c] * s**3 * dot / d
    g_kv, g_score, g_ape = backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_x, ratio, coff)
    return g_kv, g_score, g_ape, grad_w
