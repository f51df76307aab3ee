"""Peak host memory of load_model against the size of the weights it loads.

    .venv/bin/python scripts/measure_load_rss.py --size-mb 1000 --file-dtype float32

Writes a random Qwen3-shaped checkpoint (one shard per layer, so writing it stays small) into a temp dir, then
loads it with load_model(device="cpu") in a fresh subprocess and prints one JSON line: the weight bytes, the peak
RSS above the baseline RSS (after the imports and a warm-up of the code paths) by getrusage ru_maxrss and by /proc
VmHWM, and their ratios. ru_maxrss cannot be reset, so it also holds the transient peak of `import torch`; VmHWM
is reset just before the load and covers the load only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # layer shapes of real models (vocab kept small: a headless load never reads the embedding)
    "qwen3-1.7b": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=6144),
    "qwen3-0.6b": dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072),
}


def layer_tensors(i: int, hf: dict, dtype) -> dict:
    import torch

    d, hd, f = hf["hidden_size"], hf["head_dim"], hf["intermediate_size"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    shapes = {
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d), "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
    }
    return {f"model.layers.{i}.{k}": torch.randn(s, dtype=dtype) * 0.02 for k, s in shapes.items()}


def write_checkpoint(out: Path, shape: str, size_mb: float, file_dtype: str) -> None:
    """A sharded checkpoint of about size_mb of layer weights, written one shard at a time."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, file_dtype)
    hf = dict(SHAPES[shape], architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1024,
              rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False,
              torch_dtype=file_dtype)
    per_layer = sum(t.numel() for t in layer_tensors(0, hf, torch.bfloat16).values()) * dtype.itemsize
    hf["num_hidden_layers"] = n_layers = max(1, round(size_mb * 2**20 / per_layer))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    weight_map = {}
    for i in range(n_layers + 1):
        name = f"model-{i + 1:05d}-of-{n_layers + 1:05d}.safetensors"
        if i < n_layers:
            sd = layer_tensors(i, hf, dtype)
        else:  # last shard: the embedding (skipped by a headless load) and the final norm
            sd = {"model.embed_tokens.weight": torch.randn(hf["vocab_size"], hf["hidden_size"], dtype=dtype),
                  "model.norm.weight": torch.ones(hf["hidden_size"], dtype=dtype)}
        save_file(sd, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, name))
        del sd
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(path: str, dtype: str) -> dict:
    """In this (fresh) process: load the checkpoint and report peak RSS above the post-import baseline."""
    import torch

    from poc.model.config import PRESETS
    from poc.model.transformer import Transformer
    from poc.model.weights import load_model

    imported = _status_kb("VmRSS") * 1024
    # page in the library code a load runs (RoPE math, dtype copies) so that the baseline holds it: it is a
    # fixed few MiB of shared code, not a copy of the weights
    Transformer(PRESETS["tiny"])
    torch.empty(1024, dtype=torch.bfloat16).copy_(torch.ones(1024))
    base = _status_kb("VmRSS") * 1024
    try:  # reset VmHWM so it covers the load only (Linux >= 4.0); ru_maxrss cannot be reset
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    t0 = time.perf_counter()
    model, _ = load_model(path, dtype=dtype, device="cpu", progress=False)
    load_s = time.perf_counter() - t0
    peak_ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak_hwm = _status_kb("VmHWM") * 1024
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {
        "weight_bytes": weights, "load_s": round(load_s, 2), "rss_after_imports": imported, "baseline_rss": base,
        "peak_above_baseline_ru_maxrss": peak_ru - base, "ratio_ru_maxrss": round((peak_ru - base) / weights, 4),
        "peak_above_baseline_vmhwm": peak_hwm - base, "ratio_vmhwm": round((peak_hwm - base) / weights, 4),
    }


def run(size_mb: float, shape: str, file_dtype: str, load_dtype: str, workdir: str | None = None) -> dict:
    """Write a checkpoint, measure its load in a fresh interpreter, return the figures."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        write_checkpoint(Path(tmp), shape, size_mb, file_dtype)
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, __file__, "--child", tmp, "--load-dtype", load_dtype],
                              capture_output=True, text=True, env=env, check=False)
        if proc.returncode:
            raise RuntimeError(f"measurement failed:\n{proc.stderr}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(res, shape=shape, file_dtype=file_dtype, load_dtype=load_dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1000)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    ap.add_argument("--file-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--load-dtype", default="auto")
    ap.add_argument("--workdir", help="where the temp checkpoint goes (default: the system temp dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.load_dtype)))
    else:
        print(json.dumps(run(args.size_mb, args.shape, args.file_dtype, args.load_dtype, args.workdir)))


if __name__ == "__main__":
    main()
