"""Next-token cross-entropy for the pipeline's last stage.

The vocabulary logits are the largest activation of a LLaMA (``b x s x V``: 2 x 2048 x 32000 is 262 MB in bf16).
``F.cross_entropy(logits.float())`` materialises them in fp32 whole, its log-softmax too, and in backward an fp32
gradient as large again. :func:`chunked_cross_entropy` computes the same loss over row chunks: each chunk is
promoted to fp32 only while it is processed, the forward keeps one fp32 scalar per row (its log-sum-exp), and the
backward writes the gradient straight into the logits' dtype.
"""
from __future__ import annotations

import torch
from torch import nn


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy over labels != -100; ``labels`` are already shifted (see ``ds_async.data``).

    ``chunk`` > 0: :func:`chunked_cross_entropy` with that many rows (tokens) per chunk.
    """
    if chunk > 0:
        return chunked_cross_entropy(logits, labels, chunk)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, chunk: int = 4096,
                          ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels, ignore_index=...)`` (mean over counted tokens), in fp32 per chunk
    of ``chunk`` rows; the gradient has the logits' dtype."""
    return _ChunkedCrossEntropy.apply(logits, labels, chunk, ignore_index)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk, ignore_index):
        flat, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        valid = y != ignore_index
        target = torch.where(valid, y, 0)
        lse = torch.empty(len(y), dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for i in range(0, len(y), chunk):
            x = flat[i:i + chunk].float()
            lse[i:i + chunk] = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, target[i:i + chunk, None]).squeeze(1)
            total += ((lse[i:i + chunk] - picked) * valid[i:i + chunk]).sum()
        count = valid.sum()
        ctx.save_for_backward(logits, target, valid, lse, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        logits, target, valid, lse, count = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        scale = grad_out.float() / count
        for i in range(0, len(target), ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            p = flat[rows].to(torch.float32, copy=True).sub_(lse[rows, None]).exp_()  # softmax
            p.scatter_add_(1, target[rows, None], -torch.ones_like(lse[rows, None]))
            p.mul_((valid[rows] * scale)[:, None])
            grad[rows] = p
        return grad.view_as(logits), None, None, None
