"""One batch of nonces through one model on one device: inputs -> forward -> post-process -> small results.

`V1Compute` holds a random model for (params, block_hash, dtype); `V2Compute` holds a loaded checkpoint.
Both split a batch into `prepare` (host work: seeds, numpy RNG; safe to run on another thread while the
device is busy with the previous batch) and `launch`/`collect` (device work), so the runner can overlap them.
The same classes run in the rank processes (poc.engine.ranks) on a pipeline stage's part of the model: a
`Stage` says whether this part makes the inputs (first), post-processes (last, and the reporter among the
last stage's tp ranks), and how activations come from the previous stage and go to the next. One device
holding the whole model is the default Stage().
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from poc import dtypes
from poc.model.compile import maybe_compile, note_new_shape
from poc.model.options import ModelOptions
from poc.model.source import V1Weights
from poc.model.transformer import Transformer
from poc.parallel.build import Part, build
from poc.protocol import v1, v2

log = logging.getLogger("poc.compute")

DTYPES = {name: getattr(torch, name) for name in dtypes.NAMES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(device: str | None) -> torch.device:
    """cpu, cuda or cuda:N (None/auto: cuda when available); anything else is an InputError naming --device."""
    from poc.errors import InputError

    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise InputError(f"--device must be cpu, cuda or cuda:N, got {device!r}", "device")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but CUDA is not available here", "device")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise InputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible", "device")
    return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Stage:
    """Where this model sits in a pipeline; Stage() is the whole model on one device."""

    first: bool = True  # makes the inputs from the seeds
    last: bool = True  # holds the final norm/head: its output is post-processed
    reporter: bool = True  # the last stage's rank whose results go back (tp rank 0)
    recv: Callable[[tuple, torch.dtype], torch.Tensor] | None = None  # the previous stage's (B, S, D) output
    send: Callable[[torch.Tensor], None] | None = None  # this stage's output to the next stage
    mark: Callable[[int], None] | None = None  # called before (0) and after (1) the forward launch (timing)

    @property
    def post(self) -> bool:
        """This rank post-processes and reports."""
        return self.last and self.reporter

    def input(self, make: Callable[[], torch.Tensor], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The forward's input: made here on the first stage, received from the previous one after it."""
        return make() if self.first else self.recv(shape, dtype)

    def forward(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.mark is not None:
            self.mark(0)
        out = run()
        if self.mark is not None:
            self.mark(1)
        return out

    def finish(self, prep, out: torch.Tensor, n: int, device: torch.device) -> "Handle | None":
        """Hand the output on whole (not the last stage: a batch padded to its compiled shape stays so for the next
        stage), or a Handle to collect its first n rows, the batch's own (the reporter); None otherwise."""
        if not self.last:
            self.send(out)
            return None
        return Handle(prep, out[:n], device) if self.reporter else None


WHOLE = Stage()


class Handle:
    """A batch whose device work was launched; `collect` waits for it."""

    def __init__(self, prep, out: torch.Tensor, device: torch.device):
        self.prep = prep
        if device.type == "cuda":
            self.host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.host.copy_(out, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = out, None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def compile_flags(compile, device: torch.device) -> tuple[bool, bool]:
    """(compile v1, compile v2) for the --compile flag: "auto" and "on" compile both protocols on CUDA, "off" and
    the CPU neither. The compiled path computes eager's bits (eager_numerics; v2 bf16 over 1000 nonces: mean L2
    3e-10, v1 fp16: |delta dist| 8e-8, benchmarks/h100/accuracy.json), so there is no accuracy reason to
    keep it off; the cost is compiling each new batch shape once (about 20 s on the first batch)."""
    from poc.errors import InputError

    mode = {True: "on", False: "off"}.get(compile, compile)
    if mode not in ("auto", "on", "off"):
        raise InputError(f"compile must be auto, on or off, got {compile!r}", "compile")
    on = device.type == "cuda" and mode != "off"
    return on, on


def _pinned(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Host tensors bound for a CUDA device are pinned, so their copy does not block the host."""
    return t.pin_memory() if t is not None and device.type == "cuda" else t


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Repeat the last row up to n rows (a short batch keeps the compiled shape; the extra rows are dropped)."""
    if t.shape[0] >= n:
        return t
    return torch.cat([t, t[-1:].expand(n - t.shape[0], *t.shape[1:])])


# --------------------------------------------------------------------------------------------------
# v1


@dataclass
class V1Prepared:
    nonces: list[int]
    x: torch.Tensor | None  # (B, S, D) float16, host (pinned on CUDA); None past the first stage
    perms: torch.Tensor | None  # (B, V) int64, host; None where nothing is post-processed


class V1Compute:
    """The v1 random model for one (params, block_hash, dtype), plus its target vector."""

    def __init__(self, params: v1.V1Params, block_hash: str, dtype: torch.dtype, device: torch.device,
                 compile: bool = False, input_workers: int = 0, executor=None, part: Part | None = None,
                 stage: Stage = WHOLE, stop=None, pool_workers: int | None = None):
        """`part`: the rank's part of the v1 model to build (parallel.build), None the whole one (`stop`: an event
        that ends the build early, a client gone; `pool_workers`: threads drawing its pool, None the CPUs)."""
        self.params, self.block_hash, self.dtype, self.device = params, block_hash, dtype, device
        self.stage = stage
        self.input_workers = input_workers  # > 0: inputs drawn by that many processes (V1InputPool)
        self._pool = None
        self._executor = executor  # shared worker processes (the engine's), or None: the pool makes its own
        t0 = time.perf_counter()
        self.model = build(V1Weights(params, block_hash), dtype, device, part, ModelOptions(pool_workers=pool_workers),
                           stop=stop)[0].fuse()
        self.target = torch.from_numpy(v1.target(block_hash, params.vocab_size)).to(device)  # float64
        self._step = maybe_compile(Transformer.layer_step, compile)
        self._post = maybe_compile(self._distances, compile)
        self.compiled = compile
        _sync(device)
        self.build_seconds = time.perf_counter() - t0

    def key(self) -> tuple:
        return (self.params, self.block_hash, self.dtype)

    def prepare(self, public_key: str, nonces: Sequence[int]) -> V1Prepared:
        p, st = self.params, self.stage
        if self.input_workers > 0 and len(nonces) > 1 and st.first and st.post:
            if self._pool is None or self._pool.batch < len(nonces):
                from poc.engine.v1inputs import PoolUnavailable, V1InputPool
                self.close()
                try:
                    self._pool = V1InputPool(len(nonces), p.seq_len, p.dim, p.vocab_size, self.input_workers,
                                             executor=self._executor)
                except PoolUnavailable as e:
                    log.warning("v1 inputs drawn in this process, slower: %s", e)
                    self.input_workers = 0
            if self._pool is not None:
                x, perms = self._pool.fill(self.block_hash, public_key, list(nonces))
                return V1Prepared(list(nonces), torch.from_numpy(x), torch.from_numpy(perms))
        x = (torch.from_numpy(v1.input_embeddings(self.block_hash, public_key, nonces, p.seq_len, p.dim))
             if st.first else None)  # float16 first, as the reference
        perms = torch.from_numpy(v1.permutations(self.block_hash, public_key, nonces, p.vocab_size)) if st.post else None
        return V1Prepared(list(nonces), _pinned(x, self.device), _pinned(perms, self.device))

    def _distances(self, logits: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
        p = torch.gather(logits.float(), 1, perms)
        u = p / torch.linalg.vector_norm(p, dim=1, keepdim=True)  # float32, as the reference
        return torch.linalg.vector_norm(u.double() - self.target[None, :], dim=1)

    @torch.inference_mode()
    def launch(self, prep: V1Prepared, pad_to: int | None = None) -> Handle | None:
        """Queue one batch on the device (a Handle where this rank reports, else None: sent on or dropped)."""
        st, p, n = self.stage, self.params, len(prep.nonces)
        B = pad_to if self.compiled and pad_to and n < pad_to else n
        x = st.input(lambda: _pad_rows(prep.x.to(self.device, non_blocking=True), B).to(self.dtype),
                     (B, p.seq_len, p.dim), self.dtype)
        if self.compiled:
            note_new_shape("PoC v1", B, p.seq_len)
        out = st.forward(lambda: self.model(x, last_only=True, logits=st.last, step=self._step))
        if st.post:
            out = self._post(out, _pad_rows(prep.perms.to(self.device, non_blocking=True), B))
        return st.finish(prep, out, n, self.device)

    def collect(self, h: Handle) -> dict:
        return {"dist": h.wait().numpy().copy()}

    def run(self, prep: V1Prepared) -> np.ndarray:
        """float64 distances, one per nonce."""
        return self.collect(self.launch(prep))["dist"]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


# --------------------------------------------------------------------------------------------------
# v2


@dataclass
class V2Prepared:
    nonces: list[int]
    seeds: torch.Tensor | None  # (B,) or (B, 8) int64 input seeds; None past the first stage
    pick: torch.Tensor | None  # (B, k) int64; None where nothing is post-processed
    haar: torch.Tensor | None  # (B, k-1, k) float32
    seq_len: int
    block_hash: str


class V2Compute:
    """A loaded checkpoint; computes artifacts for any (block_hash, public_key, nonces, seq_len, k_dim)."""

    def __init__(self, model, cfg, dtype: torch.dtype, device: torch.device, name: str, compile: bool = False,
                 compile_inputs: bool = True, compile_model: bool = True, stage: Stage = WHOLE):
        """model: built (parallel.build) with the options it computes with (ModelOptions.compiled: built for layers
        compiled as `compile and compile_model` says, so its MoE dispatch compiles its elementwise steps too)."""
        self.model, self.cfg, self.dtype, self.device, self.name = model.fuse(), cfg, dtype, device, name
        self.stage = stage
        self._vectors: tuple[str, torch.Tensor] | None = None
        self._keys: torch.Tensor | None = None
        # three compiled pieces, each small: the inputs, one layer (reused by all), the projection
        self._inputs = maybe_compile(v2.inputs_from_seeds, compile and compile_inputs)
        self._step = maybe_compile(Transformer.layer_step, compile and compile_model)
        self._project = maybe_compile(v2.project_tensors, compile)
        self.compiled = compile
        self.computes = self.model.computes()  # what the model computes (/health), as it was built

    def reflections(self, block_hash: str) -> torch.Tensor:
        if self._vectors is None or self._vectors[0] != block_hash:
            v = v2.layer_vectors(block_hash, self.cfg.n_layers, self.cfg.dim, self.device)
            self._vectors = (block_hash, v.to(self.dtype))
        return self._vectors[1]

    def prepare(self, block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, k_dim: int,
                stronger_rng: bool = False) -> V2Prepared:
        st = self.stage
        seeds = v2.input_seeds(block_hash, public_key, nonces, stronger_rng) if st.first else None
        pl = v2.plan(block_hash, public_key, nonces, self.cfg.dim, k_dim, "cpu") if st.post else None
        pick, haar = (pl.pick, pl.haar) if pl is not None else (None, None)
        return V2Prepared(list(nonces), *(_pinned(t, self.device) for t in (seeds, pick, haar)), seq_len=seq_len,
                          block_hash=block_hash)

    @torch.inference_mode()
    def launch(self, prep: V2Prepared, pad_to: int | None = None) -> Handle:
        dev = self.device  # the RoPE table grows or moves in Transformer.forward, outside any compiled graph
        st, S, D, n = self.stage, prep.seq_len, self.cfg.dim, len(prep.nonces)
        B = pad_to if self.compiled and pad_to and n < pad_to else n

        def on_device(t):
            return _pad_rows(t.to(dev, non_blocking=True), B)

        x = st.input(lambda: self._inputs(on_device(prep.seeds), S, D, self.keys(S)).to(self.dtype), (B, S, D),
                     self.dtype)
        if self.compiled:
            note_new_shape(f"PoC v2 ({self.name})", B, S)
        refl = self.reflections(prep.block_hash)
        out = st.forward(lambda: self.model(x, reflections=refl, last_only=True, step=self._step))
        if st.post:
            out = self._project(out, on_device(prep.pick), on_device(prep.haar))
        return st.finish(prep, out, n, dev)

    def keys(self, seq_len: int) -> torch.Tensor:
        n = seq_len * self.cfg.dim
        if self._keys is None or self._keys.numel() < n:
            self._keys = v2.hash_keys(n, self.device)
        return self._keys

    def collect(self, h: Handle) -> dict:
        arts, dropped = v2.artifacts(h.prep.nonces, h.wait())
        return {"artifacts": arts, "dropped": dropped}

    def vectors(self, prep: V2Prepared) -> torch.Tensor:
        """(B, k) float32 unit vectors (host)."""
        return self.launch(prep).wait()

    def run(self, prep: V2Prepared) -> tuple[list[dict], list[int]]:
        """(artifacts, nonces dropped for NaN/Inf)."""
        out = self.collect(self.launch(prep))
        return out["artifacts"], out["dropped"]
