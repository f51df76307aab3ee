"""Tensor parallel as a rewrite of a built model: attention by heads, the MLP by columns/rows.

q/k/v (and their biases) and gate/up keep the rows of this rank's heads / ffn columns; o_proj and down_proj keep
the matching input columns and produce partial sums, so one all-reduce after each restores the full output.
Apply before `fuse()` (which concatenates the already-sliced q/k/v and gate/up) and, for a checkpoint, on the
meta-built model: the returned plan tells the loader which slice of each tensor to read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from poc.model.transformer import Transformer

Plan = dict[str, tuple[int, int, int]]  # parameter name -> (dim, start, stop) of the full tensor


def tp_plan(model: Transformer, tp_rank: int, tp_size: int) -> Plan:
    """The slice of every sharded parameter that tp rank `tp_rank` of `tp_size` holds (layers present only)."""
    cfg = model.cfg
    hd = cfg.head_dim
    q = _part(cfg.n_heads, tp_rank, tp_size)
    kv = _part(cfg.n_kv_heads, tp_rank, tp_size)
    f = _part(cfg.ffn_dim, tp_rank, tp_size)
    plan: Plan = {}
    for key, block in model.layers.items():
        if block is None:
            continue
        a, m = f"layers.{key}.self_attn.", f"layers.{key}.mlp."
        # contiguous head ranges keep GQA intact: query head j uses kv head j // n_rep on the same rank
        rows = {"q_proj": (q[0] * hd, q[1] * hd), "k_proj": (kv[0] * hd, kv[1] * hd),
                "v_proj": (kv[0] * hd, kv[1] * hd)}
        for name, (s, e) in rows.items():
            plan[a + name + ".weight"] = (0, s, e)
            if cfg.qkv_bias:
                plan[a + name + ".bias"] = (0, s, e)
        plan[a + "o_proj.weight"] = (1, q[0] * hd, q[1] * hd)
        plan[m + "gate_proj.weight"] = (0, *f)
        plan[m + "up_proj.weight"] = (0, *f)
        plan[m + "down_proj.weight"] = (1, *f)
    return plan


def apply_tp(model: Transformer, tp_rank: int, tp_size: int, group: "dist.ProcessGroup | None") -> Plan:
    """Shard `model` in place for rank `tp_rank` of `tp_size` and return the plan (name -> (dim, start, stop)).

    Works on meta parameters (shapes only; load the slices afterwards) and on real ones (sliced copies).
    With a group, an all-reduce of the whole output follows o_proj and down_proj; without one (tests), the
    caller sums the partial outputs. o_proj's bias stays on tp rank 0 only, so it is added once.
    """
    cfg = model.cfg
    if tp_size == 1:
        return {}
    for name, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim)):
        if n % tp_size:
            raise ValueError(f"{name}={n} is not divisible by tp={tp_size}")
    if any(cfg.is_moe_layer(int(k)) for k, b in model.layers.items() if b is not None):
        raise ValueError("tensor parallel of MoE layers is not implemented yet (run Qwen3-MoE with tp=1)")
    plan = tp_plan(model, tp_rank, tp_size)
    params = dict(model.named_parameters())
    for name, (dim, start, stop) in plan.items():
        owner, attr = _owner(model, name)
        setattr(owner, attr, nn.Parameter(_narrow(params[name], dim, start, stop), requires_grad=False))
    for block in model.layers.values():
        if block is None:
            continue
        attn, mlp = block.self_attn, block.mlp
        if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
            raise ValueError("apply_tp must run before fuse()")
        attn.n_heads //= tp_size  # local head counts live on the module; the config stays whole
        attn.n_kv_heads //= tp_size
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.out_features, lin.in_features = lin.weight.shape
        if tp_rank != 0 and attn.o_proj.bias is not None:
            attn.o_proj.bias = None
        if group is not None:
            attn.o_proj.forward = _row_parallel(attn.o_proj, group)
            mlp.down_proj.forward = _row_parallel(mlp.down_proj, group)
    return plan


def _part(n: int, rank: int, size: int) -> tuple[int, int]:
    k = n // size
    return rank * k, (rank + 1) * k


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, attr = name.rsplit(".", 1)
    return model.get_submodule(path), attr


def _narrow(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    part = t.detach().narrow(dim, start, stop - start)
    return part if part.is_meta else part.contiguous().clone()  # a real slice must not pin the full tensor


_MM_OUT_DTYPE = [True]  # torch.mm(..., out_dtype=) (CUDA, torch >= 2.8); off after the first failure


def _row_parallel(lin: nn.Linear, group):
    """The forward of a tp rank's o_proj / down_proj: its partial product is kept in float32, summed in float32
    over the ranks and rounded once, as one device rounds its whole fp32-accumulated product once. (An all-reduce
    of half-precision partials rounds each partial and the sum: at bf16 that moved artifacts by L2 0.029.)"""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float16, torch.bfloat16):
            y = torch.nn.functional.linear(x, lin.weight, lin.bias)
        else:
            y = None
            if x.is_cuda and _MM_OUT_DTYPE[0]:
                try:
                    y = torch.mm(x.reshape(-1, x.shape[-1]), lin.weight.t(), out_dtype=torch.float32)
                    y = y.view(*x.shape[:-1], y.shape[-1])
                except (RuntimeError, TypeError, NotImplementedError):
                    _MM_OUT_DTYPE[0] = False
            if y is None:
                y = torch.nn.functional.linear(x.float(), lin.weight.float())
            if lin.bias is not None:  # tp rank 0 only: added once
                y = y + lin.bias.float()
        # the WHOLE output: reducing only part of it is right at batch 1 and wrong from batch 2 on
        dist.all_reduce(y, group=group)
        return y.to(x.dtype)

    return forward
