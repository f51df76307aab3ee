"""PoC v1's random model: weights drawn from the block hash under the reference's names, laid out for ours.

The weights are bit-exact with the reference (spec-v1 §2): the float32 pool comes from numpy's PCG64 (one
stream, drawn by several threads: poc.protocol.pool), is moved to the device once, and every parameter is a
slice (or tiled rotation) of it there, so building a 17.8B-parameter model costs one pass of the RNG plus
device copies. The reference's interleaved RoPE pairs
(2i, 2i+1) become our rotate_half pairs (i, i + hd/2) by a row permutation of wq and wk inside each head;
q·k products are unchanged, so the model computes the same function up to float summation order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from poc.model.config import ModelConfig
from poc.model.transformer import Transformer
from poc.protocol import v1
from poc.protocol.pool import CHUNK, ArrayWriter, PieceWriter, draw_pool

# Llama 3.1 scaling constants the v1 reference hard-codes (spec-v1 §1.5)
V1_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

# reference name suffix -> our (HF) name suffix
_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def v1_config(p: v1.V1Params) -> ModelConfig:
    return ModelConfig(
        dim=p.dim, n_layers=p.n_layers, n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, head_dim=p.head_dim,
        ffn_dim=p.ffn_dim, vocab_size=p.vocab_size, norm_eps=p.norm_eps, rope_theta=p.rope_theta,
        rope_scaling=dict(V1_ROPE_SCALING) if p.use_scaled_rope else None, qkv_bias=False, qk_norm=False,
        tie_embeddings=False, max_seq_len=p.seq_len, family="llama", torch_dtype="float16")


def hf_name(ref_name: str) -> str | None:
    """Our parameter name for a reference name; None for tok_embeddings (in the pool, never used)."""
    if ref_name == "tok_embeddings.weight":
        return None
    if ref_name == "output.weight":
        return "lm_head.weight"
    if ref_name == "norm.weight":
        return "norm.weight"
    _, i, rest = ref_name.split(".", 2)
    return f"layers.{i}.{_NAMES[rest]}"


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k projection rows from interleaved RoPE pairs to rotate_half pairs, per head."""
    out_f, d = w.shape
    hd = out_f // n_heads
    # (H, hd/2, 2, D) -> (H, 2, hd/2, D): row 2i of a head goes to i, row 2i+1 to hd/2 + i
    return w.view(n_heads, hd // 2, 2, d).transpose(1, 2).reshape(out_f, d)


class _CudaPieceWriter:
    """A worker's piece on the GPU: the worker casts into one of two pinned buffers while the other is copied
    on the worker's own stream, so the host-to-device copies overlap the drawing."""

    def __init__(self, piece: torch.Tensor, chunk: int):
        self.piece = piece
        self.stream = torch.cuda.Stream(piece.device)
        n = max(1, min(chunk, len(piece)))
        self.bufs = [torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]  # bufs[i] may be written again
        self.i = 0

    def view(self, at: int, n: int) -> np.ndarray:
        b = self.i % 2
        self.copied[b].synchronize()  # returns at once before the first record
        return self.bufs[b].numpy()[:n]

    def commit(self, at: int, n: int) -> None:
        b = self.i % 2
        with torch.cuda.device(self.piece.device), torch.cuda.stream(self.stream):
            self.piece[at:at + n].copy_(self.bufs[b][:n], non_blocking=True)
            self.copied[b].record(self.stream)
        self.i += 1

    def close(self) -> None:
        self.stream.synchronize()  # the assembling thread reads the piece on its own stream next


class BuildStopped(Exception):
    """A v1 model build given up because its job was stopped (its client went away)."""


class _Stoppable:
    """A piece writer that gives up as soon as `stop` is set: each chunk a drawing thread asks for checks it."""

    def __init__(self, writer, stop):
        self._w, self._stop = writer, stop

    def view(self, at: int, n: int):
        if self._stop.is_set():
            raise BuildStopped("the v1 model build was stopped")
        return self._w.view(at, n)

    def __getattr__(self, name):
        return getattr(self._w, name)


class _TorchSink:
    """draw_pool's destination: the pool as one float32 tensor on `device`. Each worker fills its own
    piece there (on CPU it casts straight into it); finished pieces are copied into place on the device."""

    def __init__(self, size: int, device: torch.device, chunk: int, stop=None):
        self.stop = stop  # a threading.Event: set, the drawing threads give up (BuildStopped)
        self.dtype = np.float32
        self.out = torch.empty(size, dtype=torch.float32, device=device)
        self.device, self.chunk = device, chunk
        self.pieces: dict[int, torch.Tensor] = {}

    def open(self, k: int, capacity: int) -> PieceWriter:
        piece = torch.empty(capacity, dtype=torch.float32, device=self.device)
        self.pieces[k] = piece
        w = _CudaPieceWriter(piece, self.chunk) if self.device.type == "cuda" else ArrayWriter(piece.numpy())
        return w if self.stop is None else _Stoppable(w, self.stop)

    def place(self, k: int, src: int, n: int, dst: int) -> None:
        piece = self.pieces.pop(k)
        if n:
            self.out[dst:dst + n].copy_(piece[src:src + n])

    def put(self, dst: int, values: np.ndarray) -> None:
        if len(values):  # a blocking copy: the caller reuses `values`
            self.out[dst:dst + len(values)].copy_(torch.from_numpy(values))


def pool_tensor(block_hash: str, size: int, device: torch.device, workers: int | None = None,
                chunk: int = CHUNK, stop=None) -> torch.Tensor:
    """The float32 pool on `device`, bit-identical to v1.weight_pool: drawn by `workers` threads (default
    poc.protocol.pool.pool_workers(): the CPU count), each copying its piece to the device
    as it goes."""
    device = torch.device(device)
    # ordinary tensors even when the caller is in inference mode (a rank builds its model inside one): the
    # worker threads, outside that thread-local mode, write into them
    with torch.inference_mode(False):
        sink = _TorchSink(size, device, chunk, stop)
        draw_pool(block_hash, size, sink, workers, chunk=chunk)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return sink.out


def build_v1_model(p: v1.V1Params, block_hash: str, dtype: torch.dtype, device="cpu", stop=None,
                   shard: Callable[[Transformer], Mapping[str, tuple[int, int, int]] | None] | None = None,
                   workers: int | None = None) -> Transformer:
    """The reference's random model for (params, block_hash), in `dtype` on `device`, with its head. `stop` (a
    threading.Event), once set, ends the build with BuildStopped within one drawn chunk or one placed tensor.
    `shard(model)` (parallel.build: a rank's part) runs on the meta model first (keep a pipeline stage, apply tensor
    parallel) and returns the slices it cut (name -> (dim, start, stop)): only the parameters and slices it kept are
    placed, the same values as in the whole model. workers: threads drawing the pool (pool_tensor)."""
    device = torch.device(device)
    cfg = v1_config(p)
    with torch.device("meta"):
        model = Transformer(cfg, with_head=True)
    model.embed_tokens = None  # tok_embeddings is in the pool's total but never used: don't hold it
    plan = (shard(model) or {}) if shard is not None else {}
    want = set(model.state_dict(keep_vars=True))
    t0 = time.perf_counter()
    pool = pool_tensor(block_hash, v1.pool_size(p.total_params), device, workers, stop=stop)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_pool = time.perf_counter()
    sd = {}
    for ref, shape in v1.param_shapes(p):
        name = hf_name(ref)
        if name is None or name not in want:
            continue
        if stop is not None and stop.is_set():
            raise BuildStopped("the v1 model build was stopped")
        w = v1.place(pool, ref, shape, block_hash)  # float32, this one parameter in full (transient)
        if name not in plan:
            w = w.to(dtype, copy=True)  # fp32 pool -> dtype, as the reference
        if ref.endswith(("wq.weight", "wk.weight")):  # a permutation inside each head: a slice comes after it
            w = interleaved_to_half(w, p.n_heads if ref.endswith("wq.weight") else p.n_kv_heads)
        if name in plan:
            dim, start, end = plan[name]
            w = w.narrow(dim, start, end - start).to(dtype, copy=True)  # only the slice is kept
        sd[name] = w.contiguous()
        del w
    del pool
    model.load_state_dict(sd, strict=True, assign=True)
    model.init_rope(device, p.seq_len)
    model.requires_grad_(False)
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    model.build_timing = {"pool": round(t_pool - t0, 3), "place": round(t1 - t_pool, 3)}
    model.build_seconds = t1 - t0
    return model
