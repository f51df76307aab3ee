"""The MoE experts' path, on tensors: dispatch the routed tokens, run the experts' GEMMs, combine the weighted outputs.

`transformer.MoE` routes (router softmax, top-k) and calls one of two dispatches with its weights:
- `dispatch_modules`: the experts as modules (before `fuse()`), one GEMM chain per expert;
- `dispatch_stacked`: the stacked experts `w13` (E, 2F, D) and `w2` (E, D, F): the (token, choice) pairs sorted by
  expert, one grouped GEMM per projection (`grouped`: torch._grouped_mm on CUDA) or, for FP8 weights computed as
  the validators compute them, `grouped_w8a8` (both GEMMs over all experts in one kernel each on CUDA:
  `kernels/fp8_gluon.py` on Hopper, `kernels/fp8_triton.py` elsewhere), then `combine`.
Both hold only this rank's experts `first .. first + n_local - 1` of `n_experts` (expert parallel): a token routed
elsewhere adds nothing here, and the caller all-reduces the partial sums. Two ways of weighing the experts:
- (Qwen3-MoE, as transformers' grouped_mm rounds) each expert output rounded to the model dtype, times its routing
  weight rounded to the model dtype, rounded again; a token's k terms summed exactly (float64);
- `weighted` (MiniMax-M2, as vLLM's fused MoE computes: ../shared/spec/minimax-m2.md step 9) the float32 routing
  weight multiplies the down projection's float32 accumulator and the product is rounded once (in the GEMM's
  epilogue on CUDA); a token's k terms are summed in float32 in selection order, then rounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from poc.model import fp8
from poc.model.numerics import mul

GROUP_ROWS = 128  # the padded expert-group layout of grouped_w8a8: each expert's rows start on a multiple of 128
# (the CUDA kernels' row tiles divide it)
GROUPED_MM_ON_CPU = False  # tests switch the grouped GEMM on for CPU tensors (torch >= 2.9 has a CPU kernel)


def swiglu(h: Tensor) -> Tensor:
    """SwiGLU on the fused gate|up output, rounding as the unfused MLP does: SiLU(gate) and its product with up each
    rounded to the model dtype (the CUDA kernels' epilogues reproduce these bits)."""
    g, u = h.chunk(2, dim=-1)
    return mul(F.silu(g), u)


def routed(index: Tensor, first: int, stop: int, n_experts: int) -> tuple[Tensor, Tensor]:
    """(rows, experts) of the (token, choice) pairs whose expert is in first..stop-1, sorted by expert; rows index
    the T*k pairs of index (T, k), experts count from first."""
    flat = index.reshape(-1)  # (T*k,): token t's choices at t*k ... t*k + k-1
    if first == 0 and stop == n_experts:
        order = flat.argsort(stable=True)
    else:
        order = ((flat >= first) & (flat < stop)).nonzero().squeeze(1)
        order = order[flat[order].argsort(stable=True)]
    return order, flat[order] - first


def positions(rows: Tensor) -> Tensor:
    """The inverse permutation of `rows`: pos[rows[p]] = p."""
    return torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=rows.device))


@torch.compiler.disable
def dispatch_modules(x: Tensor, weights: Tensor, index: Tensor, experts: Sequence[Callable[..., Tensor]],
                     first: int, n_experts: int, weighted: bool = False) -> Tensor:
    """Sum over each token's k chosen experts of weight * expert(token), for x (T, D) and the routing weights and
    expert indices (T, k); experts[j] is expert first + j. Each weighted output is rounded to the model dtype
    (`weighted`: the expert applies the float32 weight to its down projection's accumulator, `expert(x, w)`); the k
    of a token are summed in fp32 (T, D) (exactly, or with `weighted` in selection order), the caller rounds once.
    Data-dependent shapes: kept out of compiled graphs."""
    T, k = index.shape
    rows, local = routed(index, first, first + len(experts), n_experts)
    counts = torch.bincount(local, minlength=len(experts)).tolist()
    w = weights.reshape(-1)
    out = x.new_zeros(T * k, x.shape[1])  # (T*k, D), in (token, choice) order; zero where another rank serves
    start = 0
    for j, n in enumerate(counts):
        if n:
            r = rows[start:start + n]
            out[r] = experts[j](x[r // k], w[r]) if weighted else mul(experts[j](x[r // k]), w[r, None])
        start += n
    out = out.view(T, k, -1)  # (T*k, D) -> (T, k, D)
    if weighted:
        return sum_in_order([out[:, c] for c in range(k)])
    return out.double().sum(dim=1).float()  # (T, D), exact


def sum_in_order(terms: Sequence[Tensor]) -> Tensor:
    """The terms added one after the other in float32 (a token's k expert terms in selection order, as vLLM's
    reduction over top-k adds them)."""
    acc = terms[0].float()
    for t in terms[1:]:
        acc = acc + t.float()
    return acc


@torch.compiler.disable
def dispatch_stacked(x: Tensor, weights: Tensor, index: Tensor, w13: Tensor, w2: Tensor, n_experts: int,
                     first: int = 0, *, w13_scale: Tensor | None = None, w2_scale: Tensor | None = None,
                     w8a8: bool = False, ue8m0: bool = False, xq: fp8.Quantized | None = None, fast: bool = False,
                     gluon: bool = True, out_dtype: torch.dtype | None = None, weighted: bool = False) -> Tensor:
    """As dispatch_modules over the stacked experts w13 (E_local, 2F, D) and w2 (E_local, D, F), experts first ..
    first + E_local - 1: the (token, choice) pairs are sorted so that these experts come first, in expert order, and
    one grouped GEMM per projection covers exactly those rows. With every expert here all shapes are static (no host
    sync: rows past the last group get weight zero); under expert parallel one host sync per layer sizes the gather
    to this rank's rows. FP8 weights (with their block scales) run W8A8 (`w8a8`, power-of-two activation scales with
    `ue8m0`) or are dequantised for the duration of this call. fast: the elementwise steps as compiled kernels (the
    engine compiles; CUDA only). xq: x quantised already (norm_quant), for the W8A8 experts; gluon: their Hopper
    kernels where they apply (grouped_w8a8). weighted: the float32 routing weights multiply the down projection's
    accumulator before its rounding and the k terms add in float32 in selection order (MiniMax-M2, vLLM's fused
    MoE), else transformers' order (the module docstring). The (T, D) sum is rounded to out_dtype (default x's)."""
    T, k = index.shape
    n_local = w13.shape[0]
    out_dtype = out_dtype or x.dtype
    key = torch.remainder(index.reshape(-1) - first, n_experts)  # this rank's experts -> 0 .. n_local-1, first
    rows = key.argsort(stable=True)  # (T*k,) into (token, choice) order
    pos = positions(rows)  # (T*k,): where each (token, choice) pair sits in that order
    ends = torch.searchsorted(key[rows], torch.arange(1, n_local + 1, device=x.device))  # group j: [ends[j-1], ends[j])
    partial = n_local < n_experts
    if partial:  # expert parallel: one host sync per layer, then only this rank's rows are gathered and computed
        n = int(ends[-1])
        if n == 0:
            return x.new_zeros(T, x.shape[1], dtype=out_dtype)
        rows = rows[:n]
    fast = fast and x.is_cuda
    act = _fast(swiglu, partial) if fast else swiglu
    n_valid = ends[-1]
    row_weight = weights.reshape(-1)[rows].float() if weighted else None  # the routed rows', in expert order
    if w8a8 and w13_scale is not None and fp8.emulation() != "dequantised":  # the validators' recipe
        y, dest = grouped_w8a8(x, rows, k, ends, w13, w13_scale, w2, w2_scale, act, xq, ue8m0=ue8m0,
                               gluon=gluon, row_weight=row_weight)
        # outputs in a padded layout: route each (token, choice) slot through dest; another rank's slots stay out
        pos = torch.where(pos < n_valid, dest[pos.clamp(max=dest.numel() - 1)], y.shape[0])
        n_valid = y.shape[0]
    else:
        y = grouped(x[rows // k], ends, w13, w2, act, w13_scale, w2_scale, row_weight=row_weight)
    if weighted:  # each row carries its weight: the k rows added in order
        comb = _fast(combine_weighted, partial) if fast else combine_weighted
        return comb(y, pos, n_valid, T, k, out_dtype)
    comb = _fast(combine, partial) if fast else combine
    return comb(y, weights.reshape(-1), pos, n_valid, T, k, out_dtype)


def grouped(xs: Tensor, ends: Tensor, w13: Tensor, w2: Tensor, act: Callable[[Tensor], Tensor] = swiglu,
            w13_scale: Tensor | None = None, w2_scale: Tensor | None = None,
            row_weight: Tensor | None = None) -> Tensor:
    """The expert outputs (N, D) of the routed copies xs (N, D), grouped by expert (group j ends at ends[j]), on
    weights in the model dtype (FP8 ones, with their block scales, dequantised for the duration of this call).
    row_weight (N,) float32: each row's down projection multiplied by it in float32, then rounded once."""
    if w13_scale is not None:
        w13, w2 = fp8.dequantize_blocks(w13, w13_scale, xs.dtype), fp8.dequantize_blocks(w2, w2_scale, xs.dtype)
    if grouped_mm_ok(xs, w13):
        offs = ends.to(torch.int32)
        h = act(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
        if row_weight is None:
            return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # (N, D); rows past ends[-1] not computed
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs, out_dtype=torch.float32)
        return (y * row_weight[:, None]).to(xs.dtype)
    y = xs.new_zeros(xs.shape)
    start = 0
    for j, stop in enumerate(ends.tolist()):
        if stop > start:
            h = act(F.linear(xs[start:stop], w13[j]))
            if row_weight is None:
                y[start:stop] = F.linear(h, w2[j])
            else:  # float32 accumulation of the model-dtype operands, weighted, rounded once
                y[start:stop] = (F.linear(h.float(), w2[j].float()) * row_weight[start:stop, None]).to(xs.dtype)
        start = stop
    return y


def grouped_mm_ok(xs: Tensor, w: Tensor) -> bool:
    """torch._grouped_mm: bf16 on Hopper or newer (or the CPU kernel when a test asks), 16-byte aligned rows."""
    if xs.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if xs.shape[1] % 8 or w.shape[1] % 8:
        return False
    if xs.is_cuda:
        return torch.cuda.get_device_capability(xs.device)[0] >= 9
    return GROUPED_MM_ON_CPU


def combine(y: Tensor, w: Tensor, pos: Tensor, n_valid: Tensor, T: int, k: int,
            out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The block's output (T, D): for each token, the sum over its k choices of expert output times routing weight
    (each product rounded to the model dtype, the sum exact: sum_exact's argument), as float32 rounded to
    out_dtype.

    y holds the expert outputs in expert-sorted order, one row per computed (token, choice) pair: all T*k of them,
    or under expert parallel only this rank's first n_valid. pos maps each (token, choice) slot to its row of y;
    slots at or past n_valid are another rank's and count as zero. Written as k gathers of whole rows added in
    float64 (exact, so their order is free): a compiled graph makes it one elementwise kernel over (T, D) that reads
    each token's k rows of y once, contiguously, and writes only the result. (As one (T, k, D) sum over k it was a
    reduction kernel whose loads strided across the k rows: 4.9 ms against 0.9 at 64k tokens on the H100.)"""
    pos, w = pos.view(T, k), w.view(T, k)
    zero = torch.zeros((), dtype=y.dtype, device=y.device)
    acc = None
    for c in range(k):
        p = pos[:, c]
        term = torch.where((p < n_valid)[:, None], mul(y[p.clamp(max=y.shape[0] - 1)], w[:, c, None]), zero)
        acc = term.double() if acc is None else acc + term.double()
    return acc.float().to(out_dtype)


def combine_weighted(y: Tensor, pos: Tensor, n_valid: Tensor, T: int, k: int,
                     out_dtype: torch.dtype = torch.float32) -> Tensor:
    """combine's gather for outputs that carry their routing weight already (`weighted`): each token's k rows of y
    added in float32 in selection order (sum_in_order), rounded to out_dtype."""
    pos = pos.view(T, k)
    zero = torch.zeros((), dtype=y.dtype, device=y.device)
    terms = []
    for c in range(k):
        p = pos[:, c]
        terms.append(torch.where((p < n_valid)[:, None], y[p.clamp(max=y.shape[0] - 1)], zero))
    return sum_in_order(terms).to(out_dtype)


_FAST: dict = {}


def _fast(fn, dynamic: bool = False):
    """fn compiled once per process (the engine's compile settings); dynamic: one graph for any row count."""
    if (fn, dynamic) not in _FAST:
        from poc.model.compile import maybe_compile

        _FAST[fn, dynamic] = maybe_compile(fn, True, dynamic=dynamic)
    return _FAST[fn, dynamic]


# ---------------------------------------------------------------------------------------------------------------
# FP8 experts in the validators' W8A8 recipe (../shared/spec/fp8-w8a8.md)


def grouped_w8a8(x: Tensor, rows: Tensor, k: int, ends: Tensor, w13: Tensor, s13: Tensor, w2: Tensor, s2: Tensor,
                 act: Callable[[Tensor], Tensor] = swiglu, xq: fp8.Quantized | None = None,
                 ue8m0: bool = False, gluon: bool = True, row_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The routed expert outputs (N, D) in the model dtype, as the fork's fused MoE computes them: each routed copy
    of a token's hidden state quantised per group (per row: the same numbers as quantising the token once), the w13
    FP8 GEMM, SwiGLU in the model dtype, quantised again, the w2 FP8 GEMM. rows: the (token, choice) pairs in expert
    order (N of them); ends: the expert groups' ends in that order (device tensor). Returns (y, dest): the outputs in
    a padded layout and where each of the N rows sits in it (y[dest] is the (N, D) result; a caller that gathers
    anyway composes dest into its own index instead).

    act is the model's SwiGLU on the fused gate|up output (`swiglu`). The rows are laid out with each expert's group
    padded to GROUP_ROWS (zero rows), so a GEMM tile never spans two experts: on CUDA one kernel per GEMM covers
    every expert (no host sync, no per-expert launch), the first with act and the re-quantisation in its epilogue
    (the same bits as act and quantize_act after it, tests/test_w8a8.py on CUDA): fp8_gluon's on Hopper,
    fp8_triton's elsewhere; on the CPU one block-scaled GEMM per expert, then act, then the quantiser. xq: x already
    quantised (norm_quant). ue8m0: both quantisers with power-of-two scales (the weights and their float32 block
    scales as the checkpoint's). gluon=False: the Triton kernels on Hopper too (same bits, slower; POC_FP8_GLUON).
    row_weight (N,) float32, the routed rows' routing weights: each w2 product multiplied by its row's weight in
    float32 before its rounding (the GEMM's epilogue on CUDA)."""
    dest, tile_expert, a_rows = padded_layout(rows, k, ends)
    rw = None
    if row_weight is not None:  # one weight per padded row (padding rows: 0)
        rw = torch.zeros(a_rows.numel(), dtype=torch.float32, device=x.device)
        rw[dest] = row_weight
    kern = fp8.kernels() if x.is_cuda and fp8.emulation() == "off" else None
    glu = gluon_kernels(x.device) if kern is not None and gluon else None
    if glu is not None and glu.fits(w13, w2):
        # Hopper: the warp-specialised kernels (the Triton kernels' bits). A 16-bit model's w13 gathers each token's
        # quantised row in its loads; a float32 model's tokens are quantised into their routed rows first
        if x.dtype == torch.float32:
            slots = torch.full((x.shape[0] * k,), -1, dtype=torch.int32, device=x.device)
            slots[rows] = dest.to(torch.int32)
            q, s = kern.quantize_scatter(x, slots.view(-1, k), a_rows, ue8m0=ue8m0)
            aq, as_ = glu.w13_swiglu_quant(q, s, w13, s13, tile_expert, x.dtype, ue8m0=ue8m0, a_pow2=ue8m0)
        else:
            qt, st = (xq.q, xq.s) if xq is not None else fp8.quantize_act(x, ue8m0=ue8m0)
            aq, as_ = glu.w13_swiglu_quant(qt, st.t(), w13, s13, tile_expert, x.dtype, a_rows, ue8m0=ue8m0,
                                           a_pow2=ue8m0)
        # w2 keeps the two-step promotion: folded it measured slower on an H200 (7.40 against 5.29 ms a MiniMax
        # layer, benchmarks/h200/minimax_experts.json), w13 faster (11.24 against 11.84)
        return glu.grouped_gemm(aq, as_, w2, s2, tile_expert, x.dtype, row_weight=rw), dest
    # each token quantised once (the quantisation is per row); its routed copies are rows of that
    qt, st = (xq.q, xq.s) if xq is not None else fp8.quantize_act(x, ue8m0=ue8m0)
    if kern is not None and w13.shape[2] % fp8.GROUP == 0 and w2.shape[2] % fp8.GROUP == 0:
        # w13, SwiGLU (act's arithmetic) and the re-quantisation in one kernel; the gather is in its loads
        aq, as_ = kern.w13_swiglu_quant(qt, fp8.col_major(st), w13, s13, tile_expert, x.dtype, a_rows,
                                        group_rows=GROUP_ROWS, ue8m0=ue8m0)
        return (kern.grouped_gemm(aq, as_, w2, s2, tile_expert, x.dtype, group_rows=GROUP_ROWS, row_weight=rw),
                dest)
    tok = rows // k
    q = torch.zeros((a_rows.numel(), x.shape[1]), dtype=fp8.FP8, device=x.device)
    q[dest] = qt[tok]
    s = torch.zeros((a_rows.numel(), st.shape[1]), dtype=torch.float32, device=x.device)
    s[dest] = st[tok]
    # one host sync per layer: each expert's GEMM takes its own row count (group j: the tiles of expert j)
    bounds = (torch.searchsorted(tile_expert, torch.arange(1, w13.shape[0] + 1, device=x.device,
                                                           dtype=torch.int32)) * GROUP_ROWS).tolist()
    n = bounds[-1] if bounds else 0
    h = fp8.fp8_grouped_mm(q[:n], s[:n], w13, s13, bounds, x.dtype)
    aq, as_ = fp8.quantize_act(act(h), ue8m0=ue8m0)
    if rw is None:
        return fp8.fp8_grouped_mm(aq, as_, w2, s2, bounds, x.dtype), dest
    return (fp8.fp8_grouped_mm(aq, as_, w2, s2, bounds, torch.float32) * rw[:n, None]).to(x.dtype), dest


def padded_layout(rows: Tensor, k: int, ends: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The routed rows laid out with each expert's group padded to GROUP_ROWS: (dest, tile_expert, a_rows). dest
    (N,): where each of the N routed rows (in expert order) lands; tile_expert (n_alloc / GROUP_ROWS,) int32: each
    row tile's expert (E for the tiles past the last group); a_rows (n_alloc,) int32: each padded row's token
    (rows // k), -1 for a padding row. n_alloc is a bound on the padded rows known without a host sync."""
    E, N = ends.numel(), rows.numel()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    pends = padded.cumsum(0)
    n_alloc = fp8.cdiv(N, GROUP_ROWS) * GROUP_ROWS + E * GROUP_ROWS
    # each routed row: its expert's padded start + its place in the expert's group
    grp = torch.repeat_interleave(torch.arange(E, device=rows.device), counts, output_size=N)
    dest = torch.arange(N, device=rows.device) - (ends - counts)[grp] + (pends - padded)[grp]
    tiles = torch.arange(0, n_alloc, GROUP_ROWS, device=rows.device)
    tile_expert = torch.searchsorted(pends, tiles, right=True).to(torch.int32)
    a_rows = torch.full((n_alloc,), -1, dtype=torch.int32, device=rows.device)
    a_rows[dest] = (rows // k).to(torch.int32)
    return dest, tile_expert, a_rows


_GLUON: dict = {}  # device index -> the fp8_gluon module, or None where it does not apply


def gluon_kernels(device: torch.device):
    """The Hopper expert kernels (model/kernels/fp8_gluon.py) for this device, or None: not sm_90, no Gluon in this
    Triton (the Triton kernels then run: the same bits, slower)."""
    if device.index not in _GLUON:
        try:
            from poc.model.kernels import fp8_gluon as mod
        except ImportError:
            mod = None
        if mod is not None and (mod.GROUP != fp8.GROUP or GROUP_ROWS % mod.ROWS):
            raise RuntimeError(f"fp8_gluon tiles {mod.GROUP}/{mod.ROWS} do not fit {fp8.GROUP}/{GROUP_ROWS}")
        if mod is not None and not mod.supported(device):
            mod = None
        _GLUON[device.index] = mod
    return _GLUON[device.index]
