"""Checks of our Transformer against a transformers model built from the same checkpoint (tests/checkpoints.py):
final-norm hidden states, logits and the v2 reflections, for the dense and the MoE parity tests alike."""

from __future__ import annotations

import torch

from poc.model.numerics import reflect

from .checkpoints import unit_rows


def check_hidden_and_logits(hf, ours, x, last_rtol: float, last_atol: float):
    """Final-norm hidden states and fp32 logits against transformers (max abs < 1e-5), and the last-position pass
    equal to the last row of the full one. Returns transformers' hidden states."""
    want = hf.model(inputs_embeds=x).last_hidden_state
    got = ours(x, last_only=False)
    assert got.shape == want.shape == (3, 11, 64)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.5  # not a trivially small output
    torch.testing.assert_close(ours(x), got[:, -1], rtol=last_rtol, atol=last_atol)  # last_only = the last row
    want_logits = hf(inputs_embeds=x).logits.float()
    got_logits = ours(x, last_only=False, logits=True)
    assert got_logits.dtype == torch.float32 and got_logits.shape == want_logits.shape
    assert (got_logits - want_logits).abs().max().item() < 1e-5
    torch.testing.assert_close(ours(x, logits=True), got_logits[:, -1], rtol=1e-6, atol=1e-5)
    return want


def hooked_hf_forward(hf, vs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """HF's final-norm hidden states with a forward hook reflecting each decoder layer's output by vs[i]."""

    def hook(i):
        def fn(module, args, out):
            if isinstance(out, tuple):
                return (reflect(out[0], vs[i]),) + out[1:]
            return reflect(out, vs[i])
        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(hf.model.layers)]
    try:
        return hf.model(inputs_embeds=x).last_hidden_state
    finally:
        for h in handles:
            h.remove()


def check_reflections(hf, ours, cfg, x) -> None:
    """Reflecting (a, r) after every layer = an HF forward hook reflecting each layer's output, norm after
    (dense and MoE models alike)."""
    vs = unit_rows(cfg.n_layers, cfg.dim)

    want = hooked_hf_forward(hf, vs, x)
    got = ours(x, reflections=vs, last_only=False)
    assert (got - want).abs().max().item() < 1e-5
    # mutation check: the reflections really act, and so does the one after the last layer
    assert (got - ours(x, last_only=False)).abs().max().item() > 0.1
    vs_last = vs.clone()
    vs_last[-1] = unit_rows(1, cfg.dim, seed=3)[0]
    assert (got - ours(x, reflections=vs_last, last_only=False)).abs().max().item() > 0.1
    # vectors in the model dtype act the same as float32 ones; the last-position pass (one query in the final
    # layer) differs from the full pass only in float summation order
    torch.testing.assert_close(ours(x, reflections=vs.to(torch.float32)), got[:, -1], rtol=0, atol=1e-5)
