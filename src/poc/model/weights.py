"""Safetensors checkpoint (one file or shards) -> Transformer, one tensor at a time.

Names: a tensor's name in the file less its `model.` prefix is the model's parameter name; a MiniMax-M2 checkpoint's
Mixtral-style MoE names are mapped onto the one MoE module (CHECKPOINT_NAMES), its multi-token-prediction layers
(`model.layers.{n_layers + i}`) are skipped with a log line, and any other tensor the model does not expect is
refused, naming it.

FP8 checkpoints (float8_e4m3fn weights with per-128x128-block weight_scale_inv, as Qwen and MiniMax ship them) are loaded for
the validators' W8A8 forward by default (fp8.py: FP8 linears stay float8 with their scales, a Qwen3-MoE model's
experts stacked float8); with fp8="dequant" (POC_FP8) they are dequantised into the model dtype at load time, one
tensor at a time (a Qwen3-MoE model's experts kept FP8 and dequantised per layer unless fp8_experts="dequant").

Host memory stays at about one copy of the weights: the model is built on meta, every tensor is read, converted
and placed on its own, and `load_state_dict(assign=True)` adopts the placed tensors without copying them again.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from tqdm import tqdm

from poc.errors import InputError
from poc.model.config import ModelConfig
from poc.model.fp8 import use_fp8_linears, use_scales
from poc.model.options import ModelOptions
from poc.model.transformer import Transformer

log = logging.getLogger("poc.weights")

FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "F8_E4M3": torch.float8_e4m3fn}  # FP8 only with its weight_scale_inv, dequantised while loading
FP8 = "F8_E4M3"
FP8_BLOCK = (128, 128)  # rows x columns of weight one weight_scale_inv entry covers (Qwen's FP8 checkpoints)
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
INDEX_FILE = "model.safetensors.index.json"
# a family's checkpoint names -> the model's (regex, replacement), applied in order after `model.` is stripped:
# MiniMax-M2's Mixtral-style sparse block (block_sparse_moe, experts' w1 = gate, w3 = up, w2 = down) is the MoE module
CHECKPOINT_NAMES = {
    "minimax_m2": ((re.compile(r"^(layers\.\d+)\.block_sparse_moe\."), r"\1.mlp."),
                   (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
                   (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
                   (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj.")),
}
# and back, to name a tensor the checkpoint lacks as the checkpoint would
CHECKPOINT_NAMES_BACK = {
    "minimax_m2": ((re.compile(r"^(layers\.\d+)\.mlp\."), r"\1.block_sparse_moe."),
                   (re.compile(r"\.experts\.(\d+)\.gate_proj\."), r".experts.\1.w1."),
                   (re.compile(r"\.experts\.(\d+)\.up_proj\."), r".experts.\1.w3."),
                   (re.compile(r"\.experts\.(\d+)\.down_proj\."), r".experts.\1.w2.")),
}
STRICT_FAMILIES = ("minimax_m2",)  # a tensor the model does not expect is an error (others: ignored, as before)
CHUNK_BYTES = 8 << 20  # staging block for dtype conversion and device copies: the only transient on top
COLUMN_BYTES = 1 << 20  # staging block for column slices: small, since the rank holds only its share


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives; read from the file header only."""

    file: Path
    key: str  # the name in the file, e.g. model.layers.0.mlp.up_proj.weight
    shape: tuple[int, ...]
    dtype: str  # safetensors code: F32, BF16, ...
    offset: int = 0  # of the first byte, from the start of the file

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * FILE_DTYPES[self.dtype].itemsize if self.dtype in FILE_DTYPES else 0


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    """'auto' -> the config's torch_dtype (float32 when absent); names like 'bf16' -> torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (cfg.torch_dtype or "float32") if dtype == "auto" else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InputError(f"dtype {dtype!r} (-> {name!r}) is not one of {', '.join(DTYPES)}", "dtype")
    return DTYPES[name]


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: from the shard index, model.safetensors, or *.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{index} is not a valid shard index ({type(e).__name__}: {e})", "model") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise InputError(f"{index} names shard files that do not exist: {', '.join(missing)}", "model")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors files in {path}", "model")
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError for a bad header or a short file, OSError for the rest
        raise InputError(f"{file} is not a valid safetensors file: {e}", "model") from None


def _data_offsets(file: Path) -> dict[str, int]:
    """Absolute byte offset of each tensor, from the header (which safe_open has already validated)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def model_name(key: str, family: str | None = None) -> str:
    """The model's parameter name of a checkpoint tensor: `model.` stripped, then the family's renames."""
    name = key.removeprefix("model.")
    for pattern, repl in CHECKPOINT_NAMES.get(family, ()):
        name = pattern.sub(repl, name)
    return name


def checkpoint_name(name: str, family: str | None = None) -> str:
    """The name a checkpoint of `family` gives the model's parameter `name` (model_name's inverse)."""
    for pattern, repl in CHECKPOINT_NAMES_BACK.get(family, ()):
        name = pattern.sub(repl, name)
    return "model." + name if name.startswith(("layers.", "embed_tokens.", "norm.")) else name


def index_checkpoint(path: str | Path, family: str | None = None) -> dict[str, TensorRef]:
    """Model parameter name (model_name: `model.` stripped, the family's renames) -> TensorRef, for every tensor in
    the checkpoint's files."""
    refs = {}
    for file in checkpoint_files(Path(path)):
        with _open(file) as f:  # safetensors checks the header and that the file is long enough
            shapes = {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()) for key in f.keys()}
        offsets = _data_offsets(file)
        for key, (shape, dtype) in shapes.items():
            name = model_name(key, family)
            if name in refs:
                raise InputError(f"{key} in {file.name} and {refs[name].key} in {refs[name].file.name} are the same "
                                 f"parameter ({name})", "model")
            refs[name] = TensorRef(file, key, shape, dtype, offsets[key])
    return refs


_LAYER = re.compile(r"^layers\.(\d+)\.")


def drop_extra_layers(refs: dict[str, TensorRef], n_layers: int) -> dict[str, TensorRef]:
    """refs without the tensors of layers past the model's n_layers (MiniMax-M2's multi-token-prediction modules,
    `model.layers.{n_layers + i}`, as vLLM and sglang name them: not part of the PoC forward), logged."""
    extra = [n for n in refs if (m := _LAYER.match(n)) and int(m.group(1)) >= n_layers]
    if extra:
        layers = sorted({int(_LAYER.match(n).group(1)) for n in extra})
        log.info("skipping %d tensors of layers %s (multi-token-prediction modules: not in the PoC forward of %d "
                 "layers)", len(extra), ", ".join(map(str, layers)), n_layers)
    return {n: r for n, r in refs.items() if n not in set(extra)}


def check_unexpected(refs: dict[str, TensorRef], model: Transformer) -> None:
    """For a strict family (STRICT_FAMILIES): every tensor is one the model has (or lm_head / embed_tokens, which a
    headless model does not read, or an FP8 weight's scales); anything else is an InputError naming it."""
    if model.cfg.family not in STRICT_FAMILIES:
        return
    known = set(model.state_dict(keep_vars=True)) | {"lm_head.weight", "embed_tokens.weight"}
    known |= {scale_name(n) for n in known if n.endswith(".weight")}
    unexpected = sorted(refs[n].key for n in refs if n not in known)
    if unexpected:
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        raise InputError(f"checkpoint has {len(unexpected)} tensors a {model.cfg.family} model does not have: "
                         f"{', '.join(unexpected[:8])}{more}", "model")


def read_tensor(ref: TensorRef, index=None) -> Tensor:
    """The tensor, or only the part `index` selects (rows or columns, as a tensor-parallel rank needs)."""
    try:
        with _open(ref.file) as f:
            return f.get_tensor(ref.key) if index is None else f.get_slice(ref.key)[index]
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"cannot read {ref.key} from {ref.file}: {e}", "model") from None


def _fill(f, buf: memoryview, ref: TensorRef) -> None:
    while buf:
        n = f.readinto(buf)
        if not n:
            raise InputError(f"{ref.file} ended inside {ref.key} (changed while loading?)", "model")
        buf = buf[n:]


def iter_state_dict(refs: dict[str, TensorRef], names: Iterable[str], dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu", shard: dict[str, tuple[int, int, int]] | None = None,
                    dtypes: dict[str, torch.dtype] | None = None) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) one at a time, each in a fresh buffer of `dtype` (default: the file's) on `device`.

    Plain positioned reads, not mmap: safetensors' mmap keeps every page it touched resident until the file is
    closed (a whole shard of extra RSS). A tensor already in the target dtype on the CPU is read straight into
    place; anything else goes through one staging block of CHUNK_BYTES, so nothing but that block is transient.

    shard: name -> (dim, start, stop) reads only that slice (a tensor-parallel rank's part): rows (dim 0) are one
    contiguous read; columns (dim 1) are read in row blocks through a small staging block (COLUMN_BYTES) keeping
    only the columns, so the transient does not grow with the model.
    dtypes: name -> dtype for the tensors not read in `dtype` (W8A8: FP8 weights as they are, their scales float32);
    an FP8 weight not named there is dequantised into `dtype`.
    """
    dtypes = dtypes or {}
    device = torch.device(device)
    staging = col_staging = None
    f, f_path = None, None
    try:
        for name in sorted(names, key=lambda n: (str(refs[n].file), refs[n].offset)):  # sequential reads
            ref = refs[name]
            if ref.dtype == FP8 and name not in dtypes:
                yield name, _load_fp8(refs, name, dtype or torch.float32, device, shard.get(name) if shard else None)
                continue
            if ref.file != f_path:
                if f is not None:
                    f.close()
                f, f_path = open(ref.file, "rb", buffering=0), ref.file
            src_dtype = FILE_DTYPES[ref.dtype]
            part = shard.get(name) if shard else None
            out = torch.empty(_sliced_shape(ref, part), dtype=dtypes.get(name, dtype or src_dtype), device=device)
            if part is not None and part[0] == 1:
                if col_staging is None:
                    col_staging = torch.empty(COLUMN_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
                _read_columns(f, ref, out, part[1], part[2], col_staging)
                yield name, out
                continue
            row_bytes = ref.nbytes // ref.shape[0] if ref.shape else 0
            f.seek(ref.offset + (part[1] * row_bytes if part is not None else 0))
            if out.dtype == src_dtype and device.type == "cpu":
                _fill(f, memoryview(out.view(-1).view(torch.uint8).numpy()), ref)
            else:
                if staging is None:
                    staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
                flat, step = out.view(-1), CHUNK_BYTES // src_dtype.itemsize
                for a in range(0, flat.numel(), step):
                    n = min(step, flat.numel() - a)
                    block = staging[: n * src_dtype.itemsize]
                    _fill(f, memoryview(block.numpy()), ref)
                    flat[a:a + n].copy_(block.view(src_dtype))
            yield name, out
    finally:
        if f is not None:
            f.close()


def scale_name(name: str) -> str:
    """The block scales of an FP8 weight: x.weight -> x.weight_scale_inv."""
    return name.removesuffix("weight") + "weight_scale_inv"


def dequantize_fp8(w: Tensor, scale_inv: Tensor, block: tuple[int, int] = FP8_BLOCK) -> Tensor:
    """float8_e4m3fn weight (out, in) x per-block scales (ceil(out/bo), ceil(in/bi)) -> float32 weight: each
    element times its block's scale, the edge blocks cropped (DeepSeek/Qwen's weight_dequant)."""
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w.float() * s


def _load_fp8(refs: dict[str, TensorRef], name: str, dtype: torch.dtype, device: torch.device,
              part: tuple[int, int, int] | None) -> Tensor:
    """Dequantise at load time, on the target device, into the model dtype (so the forward is the plain one).
    A tensor-parallel slice is cut after dequantising (the whole tensor is transient, one tensor at a time)."""
    w = read_tensor(refs[name]).to(device)
    w = dequantize_fp8(w, read_tensor(refs[scale_name(name)]).to(device)).to(dtype)
    if part is not None:
        _sliced_shape(refs[name], part)  # the same checks as a plain read
        w = w.narrow(part[0], part[1], part[2] - part[1]).contiguous()
    return w


def _sliced_shape(ref: TensorRef, part: tuple[int, int, int] | None) -> tuple[int, ...]:
    if part is None:
        return ref.shape
    dim, start, stop = part
    if dim not in (0, 1) or dim >= len(ref.shape) or not 0 <= start < stop <= ref.shape[dim]:
        raise ValueError(f"cannot read slice {part} of {ref.key} with shape {list(ref.shape)}")
    shape = list(ref.shape)
    shape[dim] = stop - start
    return tuple(shape)


def _read_columns(f, ref: TensorRef, out: Tensor, start: int, stop: int, staging: Tensor) -> None:
    """Columns start:stop of a 2-D tensor into out, a block of whole rows at a time (or a row's span, for rows
    longer than the staging block); the file is read sequentially."""
    src_dtype = FILE_DTYPES[ref.dtype]
    n_rows, n_cols = ref.shape
    size = src_dtype.itemsize
    row_bytes = n_cols * size
    if row_bytes <= staging.numel():
        per = staging.numel() // row_bytes
        f.seek(ref.offset)
        for r in range(0, n_rows, per):
            n = min(per, n_rows - r)
            block = staging[: n * row_bytes]
            _fill(f, memoryview(block.numpy()), ref)
            out[r:r + n].copy_(block.view(src_dtype).view(n, n_cols)[:, start:stop])
    else:  # rows longer than the block: each row's span, a block at a time
        per = staging.numel() // size
        for r in range(n_rows):
            f.seek(ref.offset + r * row_bytes + start * size)
            for c in range(0, stop - start, per):
                n = min(per, stop - start - c)
                block = staging[: n * size]
                _fill(f, memoryview(block.numpy()), ref)
                out[r, c:c + n].copy_(block.view(src_dtype))


def expected_keys(model: Transformer) -> list[str]:
    """State-dict names the checkpoint must supply (a tied lm_head is embed_tokens' matrix, not a tensor)."""
    keys = list(model.state_dict(keep_vars=True))
    if model.cfg.tie_embeddings and model.embed_tokens is not None:
        keys.remove("lm_head.weight")
    return keys


def check_checkpoint(refs: dict[str, TensorRef], model: Transformer, names: list[str]) -> None:
    """Every name present, with the model's shape and a float dtype; raise InputError otherwise, before any read."""
    missing = [checkpoint_name(n, model.cfg.family) for n in names if n not in refs]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise InputError(f"checkpoint lacks {len(missing)} tensors: {', '.join(missing[:8])}{more}", "model")
    shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    for n in names:
        ref = refs[n]
        if ref.shape != shapes[n]:
            raise InputError(
                f"{ref.key} in {ref.file.name} has shape {list(ref.shape)} but config.json implies "
                f"{list(shapes[n])}", "model")
        if ref.dtype not in FILE_DTYPES:
            raise InputError(f"{ref.key} has dtype {ref.dtype}; only float checkpoints are supported", "model")
        if ref.dtype == FP8:
            _check_fp8(refs, model, n)


def _check_fp8(refs: dict[str, TensorRef], model: Transformer, name: str) -> None:
    ref, s = refs[name], refs.get(scale_name(name))
    if model.cfg.fp8_block is None:
        raise InputError(f"{ref.key} is float8_e4m3fn but config.json has no quantization_config", "model")
    if len(ref.shape) != 2:
        raise InputError(f"{ref.key} is float8_e4m3fn with shape {list(ref.shape)}; only 2-D weights", "model")
    if s is None:
        raise InputError(f"{ref.key} is float8_e4m3fn but the checkpoint lacks its weight_scale_inv", "model")
    want = tuple(-(-d // b) for d, b in zip(ref.shape, FP8_BLOCK))
    if s.shape != want or s.dtype not in FILE_DTYPES or s.dtype == FP8:
        raise InputError(f"{s.key} has shape {list(s.shape)} and dtype {s.dtype}; {list(ref.shape)} in "
                         f"{list(FP8_BLOCK)} blocks needs float scales of shape {list(want)}", "model")


def use_fp8(model: Transformer, refs: dict[str, TensorRef],
            options: ModelOptions) -> tuple[dict[str, torch.dtype], bool]:
    """Prepare a meta-built model (before tensor parallel) for an FP8 checkpoint's forward: with W8A8 (options.fp8,
    the default) every FP8 attention / dense-MLP linear that has its scales becomes an fp8.Fp8Linear. Returns the
    loader's dtype overrides (those weights read as float8, their scales as float32) and whether a sparse layer's
    FP8 experts are loaded stacked as float8 (keep_fp8_experts: always for W8A8; under dequant when
    options.fp8_experts is `keep`, dequantised per layer in the forward: the same numbers in half the memory, where
    `dequant` dequantises everything at load)."""
    if model.cfg.fp8_block is None:
        return {}, False
    if options.fp8 != "w8a8":
        return {}, options.fp8_experts == "keep"
    names = use_fp8_linears(model, lambda n: n in refs and refs[n].dtype == FP8 and scale_name(n) in refs)
    dtypes = {n: torch.float8_e4m3fn for n in names}
    dtypes.update({scale_name(n): torch.float32 for n in names})
    return dtypes, True


def keep_fp8_experts(model: Transformer, refs: dict[str, TensorRef], device: torch.device,
                     w8a8: bool = False) -> set[str]:
    """Load every sparse layer whose experts are FP8 as stacked float8 weights with their block scales
    (MoE.set_fp8, computed W8A8 when `w8a8`), for the experts this model holds; return the weight names so loaded
    (not to be read again).
    A layer whose expert width is not a whole number of 128-blocks (gate|up would share a block row) is left to
    the dequantising loader."""
    from poc.model.transformer import MoE

    done: set[str] = set()
    F, D = model.cfg.moe_ffn_dim, model.cfg.dim
    for key, block in model.layers.items():
        if block is None or not isinstance(block.mlp, MoE) or F % FP8_BLOCK[0]:
            continue
        moe = block.mlp
        names = [[f"layers.{key}.mlp.experts.{j}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
                 for j in range(moe.first, moe.stop)]
        if not all(refs[n].dtype == FP8 for trio in names for n in trio):
            continue
        n, fb, db = len(names), F // FP8_BLOCK[0], -(-D // FP8_BLOCK[0])
        w13 = torch.empty(n, 2 * F, D, dtype=torch.float8_e4m3fn, device=device)
        s13 = torch.empty(n, 2 * fb, db, dtype=torch.float32, device=device)
        w2 = torch.empty(n, D, F, dtype=torch.float8_e4m3fn, device=device)
        s2 = torch.empty(n, db, -(-F // FP8_BLOCK[1]), dtype=torch.float32, device=device)
        for i, (gate, up, down) in enumerate(names):  # one expert at a time: the host holds one tensor
            w13[i, :F], w13[i, F:] = read_tensor(refs[gate]).to(device), read_tensor(refs[up]).to(device)
            s13[i, :fb] = read_tensor(refs[scale_name(gate)]).to(device, torch.float32)
            s13[i, fb:] = read_tensor(refs[scale_name(up)]).to(device, torch.float32)
            w2[i], s2[i] = read_tensor(refs[down]).to(device), read_tensor(refs[scale_name(down)]).to(device, torch.float32)
            done.update((gate, up, down))
        moe.set_fp8(w13, s13, w2, s2, w8a8=w8a8)
    return done


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu",
               with_head: bool = False, progress: bool = True, options: ModelOptions | None = None,
               shard: Callable[[Transformer], Mapping[str, tuple[int, int, int]] | None] | None = None,
               ) -> tuple[Transformer, ModelConfig]:
    """Build the model of a HF checkpoint directory on meta and fill it from its safetensors, in eval mode.
    options (ModelOptions, the defaults when None): how it is built and computed, among them an FP8 checkpoint's
    forward (fp8: w8a8 or dequant), W8A8's scale format (fp8_scales: ue8m0, applied by fp8.use_scales, or float32),
    a Qwen3-MoE's FP8 experts under dequant (fp8_experts) and the attention recipe (attention_for).

    `shard(model)` (parallel.build: a rank's part) runs on the meta model after the whole model is checked against
    the file headers: it keeps a pipeline stage and applies tensor/expert parallel, returning the slices it cut
    (name -> (dim, start, stop) of the full tensor). Only those rows / columns are read, and of a Qwen3-MoE sparse
    layer only the experts it kept (FP8 ones with their scales, sliced on 128-blocks: fp8.scale_slice; the scale
    format is then taken on the slice, so UE8M0 re-quantises a slice as that part of the whole): a rank's peak host
    memory is about its part."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"model directory {path} does not exist", "model")
    options = options or ModelOptions()
    cfg = ModelConfig.from_hf(path)
    dtype = resolve_dtype(dtype, cfg)
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(cfg, with_head=with_head, options=options)
    # unused tensors (lm_head without a head, rotary inv_freq, ...) are never read
    refs = drop_extra_layers(index_checkpoint(path, cfg.family), cfg.n_layers)
    dtypes, stack_experts = use_fp8(model, refs, options)
    dtypes.update({n: torch.float32 for n in model.float32_params()})  # a float32 router stays float32
    check_checkpoint(refs, model, expected_keys(model))  # the whole model against the file headers: reads nothing
    check_unexpected(refs, model)
    plan = (shard(model) or {}) if shard is not None else {}
    names = expected_keys(model)
    if stack_experts:
        kept = keep_fp8_experts(model, refs, device, w8a8=options.fp8 == "w8a8")
        names = [n for n in names if n not in kept]

    sd = {}
    total = sum(refs[n].nbytes for n in names)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}", file=sys.stderr,
              disable=not progress) as bar:
        for name, t in iter_state_dict(refs, names, dtype, device, shard=plan, dtypes=dtypes):
            sd[name] = t
            bar.update(refs[name].nbytes)
    model.load_state_dict(sd, assign=True, strict=False)
    del sd
    model.tie_weights()
    left = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise InputError(f"checkpoint did not fill {', '.join(left)}", "model")
    model.init_rope(device)
    model.requires_grad_(False)
    finish_fp8(model, options)
    return model.eval(), cfg


def finish_fp8(model: Transformer, options: ModelOptions) -> None:
    """A loaded (and sharded) model of an FP8 checkpoint computed W8A8 takes its scale format (fp8.use_scales)."""
    if model.cfg.fp8_block is not None and options.fp8 == "w8a8":
        use_scales(model, options.fp8_scales)
