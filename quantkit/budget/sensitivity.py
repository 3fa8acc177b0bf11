"""How much mean KL each unit adds at each precision, predicted from one forward and one backward pass per batch.

For a small change δ in the logits, KL(p || p + δ) ≈ ½ δᵀ F δ, with F = diag(p) − p pᵀ the Fisher information of
the model's own output distribution. At the head the logits are the head's output, so its KL is that form exactly:
½ Σ_pos [Σ p δ² − (Σ p δ)²] with δ = x (Q(W) − W)ᵀ. Deeper in, F is pulled back to a Linear's output y as E[g gᵀ]
for g = ∂(−log p(t)) / ∂y with the token t drawn from the model itself, and the KL a unit adds is predicted as
½ Σ g² Δy² over its Linears' outputs and the tokens (F's diagonal, one drawn token per position), divided by the
tokens. A vocabulary table (`--embeddings auto`) is scored the same way at the embedding's output, Δy the
looked-up rows' error, plus, when the head is tied to it, at the logits. Why the head is not scored by the diagonal
too: its Δ moves every logit of a position together, which the softmax ignores, and the diagonal does not see that
(the − (Σ p δ)² term): a per-32 int8 tied table on SmolLM2 was predicted at 0.00090 nats where it measures 0.0001.
The stated approximations: F's diagonal below the head; units add (the KL of a mix is the sum of its units');
Q is round-to-nearest (GPTQ and AWQ lose less, so a mix quantized with them comes in under its prediction).
The rounds of a KL budget correct for what remains.

Cost: per calibration row one forward and one backward of the dense model (about three forwards) plus, per
choice, one GEMM per Linear (a forward's worth); the model is held whole, in float32 (a 1.5B model: 6 GB, and
its Q(W) − W are made again for each row rather than kept, which would take 8 GB more).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from quantkit.budget.plan import Choice, Unit, fits
from quantkit.config import EMBED, HEAD
from quantkit.quant.rtn import rtn

KEEP_ERRORS_BYTES = 2 << 30  # every Linear's Q(W) - W per choice is kept (bf16) up to this; beyond, made again per row


def weight_errors(module: nn.Linear | nn.Embedding, choices: list[Choice], unit: Unit, scale_dtype: torch.dtype) -> dict[str, Tensor]:
    """Q(W) − W [out, in] per quantized choice that fits the unit (round-to-nearest, as the checkpoint would round)."""
    from quantkit.kernels.fused import native_bf16

    w = module.weight.detach().float()
    dtype = torch.bfloat16 if w.device.type == "cuda" or native_bf16() else torch.float32
    return {c.label: (rtn(w, c.scheme, scale_dtype).dequantize(torch.float32) - w).to(dtype)
            for c in choices if c.scheme is not None and fits(c, unit)}


@torch.no_grad()
def _accumulate(acc: dict[str, Tensor], x: Tensor, g: Tensor, errors: dict[str, Tensor], scale: Tensor | None) -> None:
    """acc[choice] += Σ g² Δy²: Δy = x ΔWᵀ for a Linear (the products in the errors' dtype, bf16 where the CPU
    multiplies it natively: a prediction needs two digits, not seven); for an embedding x holds token ids and Δy is
    ΔW's rows (times the family's embedding scale)."""
    g2 = g.reshape(-1, g.shape[-1]).float().pow(2)
    lookup = not x.is_floating_point()
    x = x.reshape(-1) if lookup else x.reshape(-1, x.shape[-1])
    for label, dw in errors.items():
        dy = dw[x].float() * (1 if scale is None else scale.float()) if lookup else (x.to(dw.dtype) @ dw.t()).float()
        acc[label] += (g2 * dy.pow(2)).sum().double()


@torch.no_grad()
def _accumulate_head(acc: dict[str, Tensor], x: Tensor, logits: Tensor, errors: dict[str, Tensor], cap: float | None,
                     rows: int = 256) -> None:
    """acc[choice] += Σ_pos [Σ p δ² − (Σ p δ)²], the exact logit Fisher: δ = x ΔWᵀ [pos, vocab] at the head's output
    (through the final soft cap's slope where the family has one), p the softmax of the final logits. In `rows`
    positions at a time: a [pos, vocab] float32 per choice is large (a 151,936-word vocabulary: 0.6 MB a position)."""
    x, logits = x.reshape(-1, x.shape[-1]), logits.reshape(-1, logits.shape[-1])
    for lo in range(0, x.shape[0], rows):
        z = logits[lo:lo + rows].float()  # [pos, vocab]
        p = z.softmax(-1)
        slope = None if cap is None else 1 - (z / cap).pow(2)  # z = cap tanh(head / cap): its slope is 1 − tanh²
        for label, dw in errors.items():
            d = (x[lo:lo + rows].to(dw.dtype) @ dw.t()).float()  # [pos, vocab]
            if slope is not None:
                d *= slope
            pd = p * d
            acc[label] += ((pd * d).sum() - pd.sum(-1).pow(2).sum()).double()


def sensitivities(model: nn.Module, units: list[Unit], choices: list[Choice], rows: Tensor, scale_dtype: torch.dtype,
                  batch: int = 1, seed: int = 0, on_batch: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """{unit name: {choice label: predicted mean KL (nats / token)}} over `rows` [n, seq] of calibration token ids.
    Dense is 0; a choice whose group does not divide a unit's widths is left out for that unit."""
    modules = {m: model.get_submodule(m) for u in units for m in u.modules}
    unit_of = {m: u for u in units for m in u.modules}
    fitting = {m: sum(c.scheme is not None and fits(c, unit_of[m]) for c in choices) for m in modules}
    keep_errors = sum(mod.weight.numel() * fitting[m] for m, mod in modules.items()) * 2 <= KEEP_ERRORS_BYTES
    errors = {m: weight_errors(mod, choices, unit_of[m], scale_dtype) for m, mod in modules.items()} if keep_errors else {}
    error_of = (lambda m: errors[m]) if keep_errors else (lambda m: weight_errors(modules[m], choices, unit_of[m], scale_dtype))
    acc = {m: {c.label: torch.zeros((), dtype=torch.float64) for c in choices if c.scheme is not None and fits(c, unit_of[m])}
           for m in modules}
    for p in model.parameters():
        p.requires_grad_(False)
    saved: dict[str, Tensor] = {}

    def keep(key, name):  # `key` the module hooked, `name` the one whose error it carries (a tied head: the embedding's)
        def hook(module, args, out):
            if isinstance(module, nn.Embedding):
                out.requires_grad_()
            saved[key] = args[0].detach()
            if key == HEAD:
                return  # scored from the final logits, after the forward
            scale = getattr(module, "embed_scale", None)
            out.register_hook(lambda g: _accumulate(acc[name], saved.pop(key), g, error_of(name), scale))
        return hook

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    hooked = [(m, mod, m) for m, mod in modules.items()]
    if EMBED in modules and head is not None and head.weight is embed.weight:
        hooked.append((HEAD, head, EMBED))  # the tied head quantizes with the table
    head_error = next((m for key, _, m in hooked if key == HEAD), None)
    cap = getattr(model.config, "final_logit_softcapping", None)
    handles = [mod.register_forward_hook(keep(key, m)) for key, mod, m in hooked]
    handles.append(embed.register_forward_hook(lambda module, args, out: out.requires_grad_()))
    gen = torch.Generator().manual_seed(seed)
    tokens = 0
    try:
        for chunk in rows.split(batch):
            logits = model(input_ids=chunk, use_cache=False).logits.float()  # [b, seq, vocab]
            if head_error is not None:
                _accumulate_head(acc[head_error], saved.pop(HEAD), logits.detach(), error_of(head_error), cap)
            with torch.no_grad():  # a token from the model's own distribution at each position (Gumbel-max)
                u = torch.rand(logits.shape, generator=gen).clamp_(min=1e-12)
                drawn = (logits.detach() - u.log_().neg_().log_()).argmax(-1)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), drawn.reshape(-1), reduction="sum")
            loss.backward()
            tokens += chunk.numel()
            if on_batch:
                on_batch()
    finally:
        for h in handles:
            h.remove()
    out: dict[str, dict[str, float]] = {}
    for u in units:
        labels = [c.label for c in choices if c.scheme is not None and fits(c, u)]
        out[u.name] = {label: 0.5 * sum(acc[m][label].item() for m in u.modules) / tokens for label in labels}
        if any(c.scheme is None for c in choices):
            out[u.name]["dense"] = 0.0
    return out
