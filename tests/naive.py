"""A deliberately naive, loop-per-row fp64 transcription of SPEC section 2.

Independent of csa_compressor.reference (no shared window code), so that the
references themselves are checked against the SPEC text.
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
