"""Will a job fit in memory? A coarse, conservative estimate checked before any work, so that a request
whose model or batch cannot fit gets a 422 with the numbers instead of an out-of-memory crash mid-job.

v1: weights = (total_params - vocab*dim) * dtype bytes (the token embedding is never materialised: inputs
are embeddings); the float32 weight pool the builder draws from, freed before the first forward; activations
of one forward at the fixed batch shape (activation_bytes) plus the last-position post-process (B x vocab
logits, permutations and their float32/float64 copies); host buffers for the batches in the pipeline. The
device peak is weights + the larger of pool and activations (they never coexist). On CUDA the host buffers
are in host RAM and PyTorch's cached-but-unused blocks count as free (the next job reuses them). With tensor and
pipeline parallel ranks (poc.parallel) each GPU holds 1/(tp x pp) of the weights and 1/tp of the MLP and attention
activations; the ranks report their own free memory after loading and after each job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poc import dtypes
from poc.errors import InputError
from poc.protocol import v1

GiB = 1 << 30


@dataclass(frozen=True)
class Estimate:
    weights: int = 0
    pool: int = 0
    activations: int = 0
    host: int = 0

    @property
    def device_total(self) -> int:
        """Peak on the device: the pool lives only while the model is built (drawing it holds about two copies),
        the activations only once it runs."""
        return max(2 * self.pool, self.weights + max(self.pool, self.activations))

    @property
    def total(self) -> int:
        """Peak when device and host are one memory (CPU)."""
        return self.device_total + self.host

    def describe(self) -> str:
        return (f"weights {self.weights / GiB:.2f} GiB + the larger of pool {self.pool / GiB:.2f} GiB (while "
                f"building) and activations {self.activations / GiB:.2f} GiB; host buffers {self.host / GiB:.2f} GiB")


def activation_bytes(batch: int, seq_len: int, dim: int, ffn_dim: int, n_heads: int, dtype_bytes: int = 4, *,
                     tp: int = 1, fused: bool = False, math_attention: bool = True) -> int:
    """Peak bytes of one forward of `batch` sequences of `seq_len` tokens on one rank, per token:
    - the SwiGLU branch in the model dtype: gate|up (2 ffn), silu, their product, plus one ffn of slack (a
      tensor-parallel rank holds 1/tp of the columns);
    - dim-wide tensors: residuals, q/k/v and the attention output in the model dtype, and the float32/float64
      temporaries of RMSNorm and RoPE: (4 * dtype_bytes + 48) * dim bytes eager (measured on CPU: ~46 fp16, ~50
      fp32); a compiled layer (`fused`) keeps those in registers: two float32 copies are counted instead;
    - one layer's float32 attention scores (n_heads * seq_len, 1/tp of the heads), only where SDPA may take its
      math kernel (`math_attention`: the CPU); CUDA's flash/cuDNN/memory-efficient kernels never materialise them.
    """
    b = dtype_bytes
    temps = 8 if fused else 48
    scores = 4 * n_heads * seq_len // tp if math_attention else 0
    return batch * seq_len * (5 * ffn_dim * b // tp + (4 * b + temps) * dim + scores)


def ffn_width(cfg, w8a8: bool = False) -> int:
    """The MLP width a token goes through: the dense ffn_dim, or for a Qwen3-MoE layer its k routed experts' rows
    (k * moe_ffn_dim) plus the gathered inputs and outputs of those rows (2 * k * dim, in ffn units of 5 values).
    w8a8: the W8A8 experts on CUDA (fp8.experts_w8a8), which gather their input in the first GEMM's loads and write
    its output quantised (one byte a value): per routed row the model-dtype output of the second GEMM (dim values)
    and the FP8 intermediate (moe_ffn_dim bytes), in the same ffn units (5 values of the model dtype, 10 bytes).
    Checked against the 30B-A3B shape at batch 64, seq 1024 (benchmarks/h100/W6Q.json): peak 32.1 GiB on one H100,
    the weights about 28 (poc.engine.auto.rank_weight_bytes), so about 4 GiB of activations; this estimate 4.4."""
    if not getattr(cfg, "n_experts", 0):
        return cfg.ffn_dim
    k = cfg.n_experts_per_tok
    if w8a8:
        sparse = (k * (2 * cfg.dim + cfg.moe_ffn_dim) + 9) // 10
    else:
        sparse = k * cfg.moe_ffn_dim + (2 * k * cfg.dim + 4) // 5
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    return max(sparse, cfg.ffn_dim if dense else 0)


def v1_total_params(p: v1.V1Params) -> int:
    """V1Params.total_params in closed form (that one walks every layer: slow for absurd n_layers)."""
    D, hd, F = p.dim, p.head_dim, p.ffn_dim
    per_layer = 2 * p.n_heads * hd * D + 2 * p.n_kv_heads * hd * D + 3 * F * D + 2 * D
    return 2 * p.vocab_size * D + p.n_layers * per_layer + D


def v1_weight_bytes(p: v1.V1Params, dtype: str) -> tuple[int, int]:
    """(model weights, float32 pool) in bytes."""
    total = v1_total_params(p)
    return (total - p.vocab_size * p.dim) * dtypes.BYTES[dtype], 4 * v1.pool_size(total)


def v1_estimate(p: v1.V1Params, batch_size: int, dtype: str, *, tp: int = 1, pp: int = 1, cuda: bool = False,
                fused: bool = False) -> Estimate:
    """One rank's share (tp x pp ranks split the weights; each builds from the whole pool)."""
    w, pool = v1_weight_bytes(p, dtype)
    act = activation_bytes(batch_size, p.seq_len, p.dim, p.ffn_dim, p.n_heads, dtypes.BYTES[dtype], tp=tp,
                           fused=fused, math_attention=not cuda)
    # last position only: logits, their permuted and normalised float32 copies, the float64 difference, and the
    # int64 permutations on the device
    act += batch_size * p.vocab_size * 36
    # up to three batches in the pipeline (prepared, running, collected): fp16 inputs and int64 permutations
    host = 3 * batch_size * (p.seq_len * p.dim * 2 + p.vocab_size * 8)
    return Estimate(weights=w // (tp * pp), pool=pool, activations=act, host=host)


def v2_estimate(cfg, batch_size: int, seq_len: int, dtype_bytes: int = 4, *, tp: int = 1, cuda: bool = False,
                fused: bool = False, w8a8: bool = False) -> Estimate:
    """The checkpoint is already loaded: only activations count (cfg is a poc.model ModelConfig; dtype_bytes the
    loaded model's: float32 on CPU by default), one rank's share with tensor parallelism. A pipeline stage also
    holds the (B, S, D) inputs of the batches it has taken ahead (at most the engine's pp + 2: 3 GiB for the 235B
    at batch 64); the activation terms' margin covers them (a Qwen3-MoE batch of 64k tokens is estimated at about
    2.5x what it measures: W6Q's peak, benchmarks/h100). w8a8: an FP8 checkpoint's W8A8 experts on CUDA (ffn_width)."""
    act = activation_bytes(batch_size, seq_len, cfg.dim, ffn_width(cfg, w8a8 and cuda), cfg.n_heads, dtype_bytes,
                           tp=tp, fused=fused, math_attention=not cuda)
    # q and the attention's output are n_heads * head_dim wide: where that is wider than the model (MiniMax-M2:
    # 6144 against 3072), the excess of those two tensors (a tp rank holds 1/tp of the heads)
    act += batch_size * seq_len * 2 * max(0, cfg.n_heads * cfg.head_dim - cfg.dim) * dtype_bytes // tp
    return Estimate(activations=act)


def return_freed_memory() -> bool:
    """Make freed tensors go back to the OS (glibc): a fixed 1 MiB mmap threshold. glibc raises its threshold to the
    size of each large block freed, after which blocks of that size come from the heap and stay resident when freed:
    a v1 build's transient copies (dtype casts, fused q/k/v and gate/up) then pushed the CPU peak to ~1.85x the
    weights and stayed resident while idle. With it the measured peak is the estimate's (tests/test_memory_cpu.py).
    False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, 1 << 20))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def trim_heap() -> bool:
    """Give the free pages inside the heap back to the OS (glibc's malloc_trim): blocks under the mmap threshold come
    from the heap, and many of them freed at once (the socket chunks of large request bodies) leave holes that stay
    resident. False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def available_bytes(device: torch.device) -> int:
    """Free memory where the job runs: the GPU's free memory plus what PyTorch's allocator holds cached but unused
    (the next job reuses it; mem_get_info counts it as taken), or MemAvailable on the host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_fits(est: Estimate, device: torch.device, *, reclaimable: int = 0, headroom: float = 0.9,
               field: str = "params", free: int | None = None, ranks: int = 1) -> None:
    """InputError(422) when `est` exceeds `headroom` of the free memory (+ what the job would free first). On CUDA
    only the device part counts (host buffers are in host RAM) and `est` is one GPU's (one rank's) share, checked
    against `free` (the tightest rank's, as the ranks report it) or this process's view of `device`; on the CPU
    the `ranks` processes share the host memory."""
    if free is None:
        free = available_bytes(device)
    free += reclaimable
    need = est.device_total if device.type == "cuda" else est.total * ranks
    if need > headroom * free:
        raise InputError(
            f"this job needs about {need / GiB:.2f} GiB on {device} ({est.describe()}), but only "
            f"{free / GiB:.2f} GiB is free and a job may plan on {headroom:.0%} of it: use smaller params, seq_len "
            f"or batch_size", field, status=422)
