"""Tensor parallel as a rewrite of a built model: attention by heads, a dense MLP by columns/rows, and a sparse
MoE block by whole experts (expert parallel inside the tp group).

q/k/v (and their biases) and gate/up keep the rows of this rank's heads / ffn columns; o_proj and down_proj keep
the matching input columns and produce partial sums, so one all-reduce after each restores the full output.
A sparse MoE block keeps its router (`gate`, and MiniMax-M2's e_score_correction_bias) whole and only experts
[r*E/N, (r+1)*E/N) on tp rank r of N (`MoE.keep_experts`); every rank routes every token, sums the terms of its own
experts in float32, and one all-reduce of those float32 partial sums (installed here after the block, as after
o_proj/down_proj) restores the block's output, rounded once. MiniMax-M2's q/k norm over all heads keeps its weights'
slice of this rank's heads, and its float32 sums of squares are all-reduced before the division by the whole width
(AllHeadsRMSNorm.sum_squares, wrapped here). The model code holds no collective.
So for a MoE model tp=N splits the attention heads N ways and the experts N ways by expert.
Apply before `fuse()` (which concatenates the already-sliced q/k/v and gate/up and stacks the kept experts) and,
for a checkpoint, on the meta-built model: the returned plan tells the loader which slice of each tensor to read,
and a MoE layer's state dict then names only the local experts, so the loader reads only those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from poc.model.fp8 import Fp8Linear, Quantized, scale_slice
from poc.model.options import TpReduce
from poc.model.transformer import AllHeadsRMSNorm, MoE, Transformer

Plan = dict[str, tuple[int, int, int]]  # parameter name -> (dim, start, stop) of the full tensor


def tp_plan(model: Transformer, tp_rank: int, tp_size: int) -> Plan:
    """The slice of every sharded parameter that tp rank `tp_rank` of `tp_size` holds (layers present only).

    A sparse MoE layer has no entries: its experts are whole tensors, kept or dropped (expert_range), and its
    router stays whole."""
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
        if block.self_attn.all_heads_norm:  # one norm over all heads: each rank its heads' weights
            plan[a + "q_norm.weight"] = (0, q[0] * hd, q[1] * hd)
            plan[a + "k_norm.weight"] = (0, kv[0] * hd, kv[1] * hd)
        if isinstance(block.mlp, MoE):
            continue
        plan[m + "gate_proj.weight"] = (0, *f)
        plan[m + "up_proj.weight"] = (0, *f)
        plan[m + "down_proj.weight"] = (1, *f)
    for name, mod in model.named_modules():  # an FP8 weight's block scales: the blocks of its slice
        w = name + ".weight"
        if isinstance(mod, Fp8Linear) and w in plan:
            dim, start, stop = plan[w]
            plan[name + ".weight_scale_inv"] = scale_slice(w, dim, start, stop, mod.weight.shape[dim])
    return plan


def apply_tp(model: Transformer, tp_rank: int, tp_size: int, group: "dist.ProcessGroup | None",
             reduce: TpReduce = "fp32") -> Plan:
    """Shard `model` in place for rank `tp_rank` of `tp_size` and return the plan (name -> (dim, start, stop)).

    Works on meta parameters (shapes only; load the slices afterwards) and on real ones (sliced copies).
    With a group, an all-reduce of the whole output follows o_proj and down_proj, and one of its float32 partial
    sums follows each sparse MoE block (expert parallel: this rank keeps experts expert_range(E, tp_rank, tp_size),
    the router stays whole). Without a group (tests), the caller sums the
    partial outputs; a MoE block then returns its partial sum rounded to the model dtype (exact in float32; sum
    fp32 partials, e.g. from experts.dispatch_modules, to match one device in half precision).
    o_proj's bias stays on tp rank 0 only, so it is added once. reduce: "fp32", or "model" to all-reduce partials
    rounded to the model dtype (ModelOptions.tp_reduce, reduce_in_model_dtype).
    """
    cfg = model.cfg
    if tp_size == 1:
        return {}
    blocks = [b for b in model.layers.values() if b is not None]
    sizes = [("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads)]
    if any(not isinstance(b.mlp, MoE) for b in blocks):
        sizes.append(("ffn_dim", cfg.ffn_dim))
    if any(isinstance(b.mlp, MoE) for b in blocks):
        sizes.append(("n_experts", cfg.n_experts))
    for name, n in sizes:
        if n % tp_size:
            raise ValueError(f"{name}={n} is not divisible by tp={tp_size}")
    half_reduce = reduce_in_model_dtype(reduce)
    plan = tp_plan(model, tp_rank, tp_size)
    params = dict(model.named_parameters())
    for name, (dim, start, stop) in plan.items():
        owner, attr = _owner(model, name)
        setattr(owner, attr, nn.Parameter(_narrow(params[name], dim, start, stop), requires_grad=False))
    for block in model.layers.values():
        if block is None:
            continue
        attn, mlp = block.self_attn, block.mlp
        moe = isinstance(mlp, MoE)
        if attn.qkv_proj is not None or (mlp.w13 is not None if moe else mlp.gate_up_proj is not None):
            raise ValueError("apply_tp must run before fuse()")
        attn.n_heads //= tp_size  # local head counts live on the module; the config stays whole
        attn.n_kv_heads //= tp_size
        lins = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if moe:
            mlp.keep_experts(*expert_range(cfg.n_experts, tp_rank, tp_size))
        else:
            lins += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        for lin in lins:
            lin.out_features, lin.in_features = lin.weight.shape
        if tp_rank != 0 and attn.o_proj.bias is not None:
            attn.o_proj.bias = None
        if group is not None:
            attn.o_proj.forward = _row_parallel(attn.o_proj, group, half_reduce)
            if attn.all_heads_norm:
                for norm in (attn.q_norm, attn.k_norm):
                    norm.sum_squares = _summed_over_ranks(norm, group)
            if moe:
                mlp.forward = _expert_parallel(mlp, group, half_reduce)
            else:
                mlp.down_proj.forward = _row_parallel(mlp.down_proj, group, half_reduce)
    return plan


def expert_range(n_experts: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first, stop): the experts of a sparse MoE layer that tp rank `tp_rank` of `tp_size` holds (an even split)."""
    if n_experts % tp_size:
        raise ValueError(f"n_experts={n_experts} is not divisible by tp={tp_size}")
    return _part(n_experts, tp_rank, tp_size)


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


def reduce_in_model_dtype(reduce: TpReduce = "fp32") -> bool:
    """reduce="model" (ModelOptions.tp_reduce, POC_TP_REDUCE): all-reduce half-precision partial sums (half the
    bytes; each partial is rounded before the sum, so results move within the dtype's rounding). Default fp32:
    partials summed in fp32, rounded once."""
    return reduce == "model"


def _expert_parallel(moe: MoE, group, half_reduce: bool = False):
    """The forward of a tp rank's sparse MoE block: the terms of its own experts summed in float32 (MoE.sum_dtype),
    all-reduced over the ranks and rounded once; with half_reduce (reduce_in_model_dtype: POC_TP_REDUCE=model) each
    rank's partial is rounded to the model dtype first (half the bytes)."""

    moe.sum_dtype = None if half_reduce else torch.float32
    block = MoE.forward  # not moe.forward: this replaces it

    def forward(x: "torch.Tensor | Quantized") -> torch.Tensor:
        dtype = (x.x if isinstance(x, Quantized) else x).dtype
        y = block(moe, x)
        dist.all_reduce(y, group=group)
        return y.to(dtype)

    return forward


def _summed_over_ranks(norm: AllHeadsRMSNorm, group):
    """AllHeadsRMSNorm.sum_squares of a tp rank: its heads' float32 sum of squares all-reduced over the ranks (the
    norm then divides by the whole width), as the validators' tensor-parallel q/k norm does."""

    def sum_squares(y: torch.Tensor) -> torch.Tensor:
        ss = AllHeadsRMSNorm.sum_squares(norm, y)  # not norm.sum_squares: this replaces it
        dist.all_reduce(ss, group=group)
        return ss

    return sum_squares


def _row_parallel(lin: nn.Linear, group, half_reduce: bool = False):
    """The forward of a tp rank's o_proj / down_proj: its partial product is kept in float32, summed in float32
    over the ranks and rounded once, as one device rounds its whole fp32-accumulated product once. (An all-reduce
    of half-precision partials rounds each partial and the sum: at bf16 that moved artifacts by L2 0.029.)
    half_reduce: round each partial to the model dtype first (reduce_in_model_dtype)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if isinstance(lin, Fp8Linear):  # W8A8 on this rank's 128-column groups; the partial in fp32 unless asked
            y = Fp8Linear.forward(lin, x, out_dtype=x.dtype if half_reduce else torch.float32)  # not lin.forward: this
        elif x.dtype not in (torch.float16, torch.bfloat16) or half_reduce:
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
