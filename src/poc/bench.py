"""End-to-end throughput benchmark on a GPU box (random weights of the real shapes, made on the GPU).

    python -m poc.bench --workload W3 W4 --batch 256 512 --out benchmarks/h100/W3.json [--hf] [--compile]
    bash benchmarks/run.sh h100 W3 W4          (the suite: one file per workload under benchmarks/<gpu-kind>/)

For each workload and batch size: nonces/s through the engine (inputs, forward, post-processing, results to
the host), TFLOP/s, % of the matmul ceiling measured in the same run, peak GPU memory, model build time and time
to the first batch. With --hf, the plain transformers forward on the same shapes (W3-W5) in the same run.
Writes JSON, and a PNG plot next to it when matplotlib is there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from poc.errors import InputError
from poc.protocol import v1  # numpy only: the workloads' params
from poc.model.options import ModelOptions  # plain data: the environment's switches
from poc.engine.jobs import steady_rate  # numpy only
from poc.engine.rankgroup import RankDiagnostics


def _import_heavy() -> None:
    """torch and the engine, as module globals. `python -m poc.bench` imports them after its flags are parsed (so
    --help and a bad flag answer at once, not after torch and dynamo load); an import of poc.bench, at once."""
    global torch, DTYPES, V2Compute, make_engine, Limits, V1Job, V2Job, PRESETS, ModelConfig, v1_config, random_model
    global Transformer
    import torch

    from poc.engine.compute import DTYPES, V2Compute
    from poc.engine.factory import make_engine
    from poc.engine.jobs import Limits, V1Job, V2Job
    from poc.model.config import PRESETS, ModelConfig
    from poc.model.random_init import v1_config
    from poc.model.random_weights import random_model
    from poc.model.transformer import Transformer


if __name__ != "__main__":
    _import_heavy()

class Switches(NamedTuple):
    """The environment's model and rank switches (README's Configuration table), read once in main()."""

    options: ModelOptions
    diagnostics: RankDiagnostics

    @classmethod
    def from_env(cls, env) -> "Switches":
        return cls(ModelOptions.from_env(env), RankDiagnostics.from_env(env))


BH = "ba5b00876d55f32856a5fbae8b4ebd79c5a90c763b23c15b7ec813cda54965ab"
PK = "03b9be7b7bcc197eadcd6cd0ab62d129aa39b94e53ea72ecacc4d95ccec859435c"

W2_PARAMS = v1.V1Params(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.3,
                        multiple_of=1024, norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=False, seq_len=1024)
WORKLOADS = {
    "W1": {"protocol": "v1", "params": v1.PARAMS_V2, "dtype": "float16", "batches": [64, 128]},
    "W2": {"protocol": "v1", "params": W2_PARAMS, "dtype": "float16", "batches": [128, 256]},
    "W3": {"protocol": "v2", "model": "qwen3-0.6b", "seq_len": 64, "dtype": "bfloat16", "batches": [512, 1024]},
    "W4": {"protocol": "v2", "model": "qwen3-0.6b", "seq_len": 1024, "dtype": "bfloat16", "batches": [64, 128]},
    "W5": {"protocol": "v2", "model": "qwen3-8b", "seq_len": 1024, "dtype": "bfloat16", "batches": [16, 32]},
    # Qwen3-MoE (issue 7): bf16 experts, and FP8 experts kept in memory (dequantised per layer)
    "W6": {"protocol": "v2", "model": "qwen3-30b-a3b", "seq_len": 1024, "dtype": "bfloat16", "batches": [16, 32]},
    # the Qwen3-30B-A3B-FP8 shape: the dequantise forward (experts FP8 in memory, dequantised per layer) and the
    # validators' W8A8 forward (FP8 x FP8 GEMMs on quantised activations), the same weights
    "W6F": {"protocol": "v2", "model": "qwen3-30b-a3b", "seq_len": 1024, "dtype": "bfloat16", "batches": [16, 32],
            "fp8": True, "fp8_forward": "dequant"},
    "W6Q": {"protocol": "v2", "model": "qwen3-30b-a3b", "seq_len": 1024, "dtype": "bfloat16", "batches": [16, 32, 64],
            "fp8": True, "fp8_forward": "w8a8", "fp8_scales": "ue8m0"},
    # the same with the float32-scale recipe (vLLM without DeepGEMM): the same kernels, other scales
    "W6Q32": {"protocol": "v2", "model": "qwen3-30b-a3b", "seq_len": 1024, "dtype": "bfloat16", "batches": [16, 32, 64],
              "fp8": True, "fp8_forward": "w8a8", "fp8_scales": "float32"},
    # Qwen3-235B-A22B (the network's PoC v2 model until 2026-06-25) with FP8 experts over 4 GPUs (heads, experts)
    "W7": {"protocol": "v2", "model": "qwen3-235b-a22b", "seq_len": 1024, "dtype": "bfloat16", "batches": [16, 32],
           "fp8": True, "tp": 4},
    # two replicas of tp=2 on the same 4 GPUs: a third of the all-reduce traffic per nonce (~120 GB of weights a GPU)
    "W7R": {"protocol": "v2", "model": "qwen3-235b-a22b", "seq_len": 1024, "dtype": "bfloat16", "batches": [32, 48],
            "fp8": True, "tp": 2, "replicas": 2},
    # one pipeline of 4 stages (23-24 layers and all 128 experts a GPU, ~62 GB): no all-reduce at all
    "W7P": {"protocol": "v2", "model": "qwen3-235b-a22b", "seq_len": 1024, "dtype": "bfloat16", "batches": [64, 96],
            "fp8": True, "tp": 1, "pp": 4},
    # the same with the experts dequantised to bf16 (what the loader does with an FP8 checkpoint by default)
    "W7D": {"protocol": "v2", "model": "qwen3-235b-a22b", "seq_len": 1024, "dtype": "bfloat16", "batches": [32, 64],
            "tp": 4},
    # MiniMax-M2.7-FP8 (the chain's PoC model): W8A8 with UE8M0 scales and the validators' FP8 attention. On one GPU
    # its first 8 of 62 layers (~29 GB: the per-layer rate); the whole model as 2 stages (two H200) or 4 (four H100)
    "W8L8": {"protocol": "v2", "model": "minimax-m2.7", "layers": 8, "seq_len": 1024, "dtype": "bfloat16",
             "batches": [32, 64], "fp8": True},
    # the layers of one pp=4 stage (16 of 62, ~55 GiB): on one H100, the rate the slowest stage of four H100 allows
    "W8L16": {"protocol": "v2", "model": "minimax-m2.7", "layers": 16, "seq_len": 1024, "dtype": "bfloat16",
              "batches": [64], "fp8": True},
    "W8P2": {"protocol": "v2", "model": "minimax-m2.7", "seq_len": 1024, "dtype": "bfloat16", "batches": [64],
             "fp8": True, "tp": 1, "pp": 2},
    "W8P4": {"protocol": "v2", "model": "minimax-m2.7", "seq_len": 1024, "dtype": "bfloat16", "batches": [64],
             "fp8": True, "tp": 1, "pp": 4},
}


def workload_config(w: dict) -> "ModelConfig":
    """The workload's model shape: its preset, with `layers` of them where it names fewer."""
    cfg = PRESETS[w["model"]]
    return replace(cfg, n_layers=w["layers"]) if w.get("layers") else cfg


def flops_per_nonce(cfg: ModelConfig, seq_len: int, head: bool) -> float:
    """2 x matmul params x S + causal attention 2 x L x S^2 x (H x hd), + one head row when there is a head.
    A MoE layer counts its router and the k experts each token uses (the active parameters)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = cfg.dim * q + 2 * cfg.dim * kv + q * cfg.dim
    mats = sum(attn + (cfg.dim * cfg.n_experts + 3 * cfg.dim * cfg.moe_ffn_dim * cfg.n_experts_per_tok
                       if cfg.is_moe_layer(i) else 3 * cfg.dim * cfg.ffn_dim) for i in range(cfg.n_layers))
    f = 2.0 * mats * seq_len + 2.0 * cfg.n_layers * seq_len * seq_len * q
    return f + (2.0 * cfg.dim * cfg.vocab_size if head else 0.0)


def cuda_time(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events (the benchmark diagnostics use it too)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def matmul_ceiling(dtype: torch.dtype, n: int = 8192) -> float:
    """Measured dense matmul TFLOP/s on random data (rotating over 3 input sets)."""
    xs = [torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(3)]
    w = torch.randn(n, n, device="cuda", dtype=dtype)
    i = [0]

    def step():
        i[0] += 1
        return xs[i[0] % 3] @ w

    t = cuda_time(step, 10)
    return 2 * n ** 3 / t / 1e12


_FP8_CEILING: list = []


def fp8_ceiling(n: int = 8192) -> float:
    """Measured TFLOP/s of the block-scaled FP8 GEMM the W8A8 forward runs (1x128 / 128x128 scales), at n^3."""
    if not _FP8_CEILING:
        from poc.model import fp8

        x = torch.randn(n, n, device="cuda").bfloat16()
        w = torch.randn(n, n, device="cuda").mul_(64).clamp_(-448, 448).to(fp8.FP8)
        ws = torch.full((n // 128, n // 128), 0.02 / 64, device="cuda")
        q, s = fp8.quantize_act(x)
        _FP8_CEILING.append(2 * n ** 3 / cuda_time(lambda: fp8.fp8_mm(q, s, w, ws, torch.bfloat16), 10) / 1e12)
        print(f"fp8 block-scaled matmul ceiling: {_FP8_CEILING[0]:.0f} TFLOP/s", flush=True)
    return _FP8_CEILING[0]


def random_v2_model(cfg: ModelConfig, dtype: torch.dtype, device, fp8: bool, w: dict,
                    opts: "ModelOptions") -> "Transformer":
    """A model of the real shape with N(0, 0.02) weights and norms near 1, made on the device (FP8 weights with
    fp8), computed as the options say, with the workload's own FP8 forward and scale format where it names them."""
    opts = replace(opts, fp8=w.get("fp8_forward") or opts.fp8, fp8_scales=w.get("fp8_scales") or opts.fp8_scales)
    return random_model(cfg, dtype, device, fp8_ckpt=fp8, options=opts)


def run_engine(engine, job, warm_batches: int, timed_batches: int) -> dict:
    """Run a job for warm + timed batches; the steady rate is over the timed ones (emit to emit)."""
    times, sizes = [], []
    t0 = time.perf_counter()

    def emit(b):
        times.append(time.perf_counter())
        sizes.append(len(b.nonces))

    job.limits = Limits(max_nonces=job.batch_size * (warm_batches + timed_batches), max_duration=None)
    engine.run(job, emit, threading.Event())
    k = warm_batches
    return {"nonces_per_s": steady_rate(times, sizes, k), "first_batch_s": times[0] - t0 if times else None,
            "batch_s": (times[-1] - times[k - 1]) / max(1, len(times) - k)}


def hf_forward_rate(cfg: ModelConfig, seq_len: int, batch: int, dtype: torch.dtype, iters: int = 10) -> dict:
    """The plain transformers Qwen3 forward (eager, SDPA) on random embeddings of the same shape."""
    from transformers import Qwen3Config, Qwen3Model

    hf_cfg = Qwen3Config(hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
                         num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                         vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps, max_position_embeddings=40960,
                         attn_implementation="sdpa")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = Qwen3Model(hf_cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    x = torch.randn(batch, seq_len, cfg.dim, device="cuda", dtype=dtype)
    with torch.inference_mode():
        t = cuda_time(lambda: model(inputs_embeds=x, use_cache=False), iters, warmup=2)
    return {"nonces_per_s": batch / t}


def bench_workload(name: str, batches: list[int], compile: bool, hf: bool, ceiling: float,
                   warm: int, timed: int, sw: Switches, compile_inputs: bool = True) -> list[dict]:
    """sw: the environment's model and rank switches (Switches.from_env); compile_inputs: the v2 input generator
    compiled with the model (POC_COMPILE_INPUTS)."""
    w = WORKLOADS[name]
    dtype = DTYPES[w["dtype"]]
    rows = []
    if w.get("tp"):
        return bench_dist(name, batches, ceiling, warm, timed, compile, sw)
    opts = sw.options
    engine = make_engine("cuda", replicas=1, compile=compile, options=opts)
    if w["protocol"] == "v1":
        engine.load()  # starts the input processes, as the server does at start
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if w["protocol"] == "v1":
        p = w["params"]
        c = engine.v1_compute(p, BH, w["dtype"])
        torch.cuda.synchronize()
        print(json.dumps({"workload": name, "v1_build_phases_s": c.model.build_timing}), flush=True)
        cfg, seq_len, head = v1_config(p), p.seq_len, True
    else:
        cfg = workload_config(w)
        model = random_v2_model(cfg, dtype, "cuda", w.get("fp8", False), w, replace(opts, compiled=compile))
        cfg = model.cfg
        engine.v2 = V2Compute(model, cfg, dtype, torch.device("cuda"), w["model"], compile=compile,
                              compile_inputs=compile_inputs)
        torch.cuda.synchronize()
        seq_len, head = w["seq_len"], False
    build = time.perf_counter() - t0
    fl = flops_per_nonce(cfg, seq_len, head)
    for b in batches:
        torch.cuda.reset_peak_memory_stats()
        if w["protocol"] == "v1":
            job = V1Job(BH, PK, 1, w["params"], v1.DEFAULT_R_TARGET, v1.worker_nonces(0, 0, 1), b, w["dtype"])
        else:
            job = V2Job(BH, PK, 1, seq_len, 12, v1.worker_nonces(0, 0, 1), b)
        try:
            r = run_engine(engine, job, warm, timed)
        except torch.OutOfMemoryError:
            rows.append({"workload": name, "batch": b, "error": "out of memory"})
            torch.cuda.empty_cache()
            continue
        row = {"workload": name, "batch": b, "dtype": w["dtype"], "fp8_experts": w.get("fp8", False),
               "fp8_forward": w.get("fp8_forward"), "fp8_scales": w.get("fp8_scales"), "seq_len": seq_len,
               "compile": compile,
               "compile_inputs": compile and compile_inputs and w["protocol"] == "v2",
               "flops_per_nonce": fl, **r, "tflops": r["nonces_per_s"] * fl / 1e12,
               "pct_of_ceiling": 100 * r["nonces_per_s"] * fl / 1e12 / ceiling,
               "flop_limit_nonces_per_s": ceiling * 1e12 / fl,
               "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2 ** 30, "model_build_s": build,
               "nonces_per_min": 60 * r["nonces_per_s"]}
        if w.get("fp8_forward") == "w8a8":
            row["pct_of_fp8_ceiling"] = 100 * row["tflops"] / fp8_ceiling()
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        rows.append(row)
    engine.v2 = None
    engine._v1 = None
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    if hf and w["protocol"] == "v2" and not cfg.n_experts:
        for b in batches:
            try:
                r = hf_forward_rate(cfg, seq_len, b, dtype)
            except torch.OutOfMemoryError:
                r = {"error": "out of memory"}
            row = {"workload": name, "batch": b, "impl": "transformers-eager-forward", **r}
            if "nonces_per_s" in r:
                row["pct_of_ceiling"] = 100 * r["nonces_per_s"] * fl / 1e12 / ceiling
            print(json.dumps(row), flush=True)
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def bench_dist(name: str, batches: list[int], ceiling: float, warm: int, timed: int, compile: bool,
               sw: Switches) -> list[dict]:
    """A workload over tp GPUs through the DistEngine (rank processes, NCCL), random weights made by each rank."""
    w = WORKLOADS[name]
    spec = f"random:{w['model']}" + (":fp8" if w.get("fp8") else "")
    t0 = time.perf_counter()
    gpus = w["tp"] * w.get("pp", 1) * w.get("replicas", 1)
    engine = make_engine("cuda", model_dir=spec, dtype=w["dtype"], tp=w["tp"], pp=w.get("pp", 1),
                         replicas=w.get("replicas", 1), compile="on" if compile else "off",
                         options=sw.options, diagnostics=sw.diagnostics)
    engine.load()
    build = time.perf_counter() - t0
    cfg, seq_len = PRESETS[w["model"]], w["seq_len"]
    fl = flops_per_nonce(cfg, seq_len, False)
    rows = []
    for b in batches:
        job = V2Job(BH, PK, 1, seq_len, 12, v1.worker_nonces(0, 0, 1), b)
        try:
            r = run_engine(engine, job, warm, timed)
        except Exception as e:  # noqa: BLE001 - a rank's OOM arrives as a RankFailure: record it, go on
            rows.append({"workload": name, "batch": b, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
            break
        row = {"workload": name, "batch": b, "dtype": w["dtype"], "fp8_experts": w.get("fp8", False), "tp": w["tp"],
               "pp": w.get("pp", 1), "replicas": w.get("replicas", 1), "gpus": gpus, "seq_len": seq_len,
               "compile": compile,
               "tp_reduce": sw.options.tp_reduce, "flops_per_nonce": fl, **r,
               "tflops": r["nonces_per_s"] * fl / 1e12,
               "pct_of_ceiling": 100 * r["nonces_per_s"] * fl / 1e12 / (ceiling * gpus),
               "flop_limit_nonces_per_s": ceiling * gpus * 1e12 / fl, "model_build_s": build,
               "nonces_per_min": 60 * r["nonces_per_s"]}
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        rows.append(row)
    engine.close()
    return rows


def check_accuracy(n_v2: int = 1000, n_v1: int = 256) -> dict:
    """The optimised (compiled) path against the plain eager path in the same dtype, on the same weights:
    v2 artifacts (W3 shape, bf16) as decoded-vector L2, v1 distances (testnet params, fp16) as |delta|."""
    import copy

    import numpy as np

    from poc.protocol import v2

    dev = torch.device("cuda")
    out = {}
    cfg = PRESETS["qwen3-0.6b"]
    model = random_v2_model(cfg, torch.bfloat16, dev)
    runs = {}
    m32 = copy.deepcopy(model).float()
    for name, comp, bs in [("eager", V2Compute(model, cfg, torch.bfloat16, dev, "eager"), 250),
                           ("eager_b100", V2Compute(model, cfg, torch.bfloat16, dev, "eager"), 100),
                           ("compiled", V2Compute(model, cfg, torch.bfloat16, dev, "compiled", compile=True), 250),
                           ("compiled_eager_inputs", V2Compute(model, cfg, torch.bfloat16, dev, "c", compile=True,
                                                               compile_inputs=False), 250),
                           ("compiled_inputs_only", V2Compute(model, cfg, torch.bfloat16, dev, "c", compile=True,
                                                              compile_model=False), 250),
                           ("eager_fp32", V2Compute(m32, cfg, torch.float32, dev, "fp32"), 250),
                           ("compiled_fp32", V2Compute(m32, cfg, torch.float32, dev, "fp32c", compile=True), 250),
                           ("eager_one_ulp", one_ulp(V2Compute(model, cfg, torch.bfloat16, dev, "u")), 250)]:
        arts = {}
        for i in range(0, n_v2, bs):
            prep = comp.prepare(BH, PK, list(range(i, min(n_v2, i + bs))), 64, 12)
            arts.update({a["nonce"]: a["vector_b64"] for a in comp.run(prep)[0]})
        runs[name] = arts

    def l2(a, b):
        d = [float(np.linalg.norm(v2.decode(a[n]) - v2.decode(b[n]))) for n in a]
        return {"mean": float(np.mean(d)), "max": float(np.max(d)), "n": len(d)}

    out["v2_compiled_vs_eager_bf16"] = l2(runs["compiled"], runs["eager"])
    out["v2_compiled_eager_inputs_vs_eager_bf16"] = l2(runs["compiled_eager_inputs"], runs["eager"])
    out["v2_compiled_inputs_only_vs_eager_bf16"] = l2(runs["compiled_inputs_only"], runs["eager"])
    out["v2_eager_bf16_vs_fp32"] = l2(runs["eager"], runs["eager_fp32"])
    out["v2_eager_bf16_batch250_vs_batch100"] = l2(runs["eager"], runs["eager_b100"])  # GEMM tiling alone
    out["v2_compiled_vs_eager_fp32"] = l2(runs["compiled_fp32"], runs["eager_fp32"])
    # the noise floor of this model in bf16: one input element of each nonce moved by one bf16 ulp
    out["v2_eager_one_input_ulp_vs_eager_bf16"] = l2(runs["eager_one_ulp"], runs["eager"])
    del model, m32, runs
    torch.cuda.empty_cache()
    p = v1.PARAMS_V1
    dists = {}
    for name, comp in [("eager", False), ("compiled", True)]:
        e = make_engine("cuda", replicas=1, compile=comp)
        dists[name] = e.v1_distances(p, BH, PK, list(range(n_v1)), "float16", batch_size=64)
        e.close()
        del e
        torch.cuda.empty_cache()
    out["v1_compiled_vs_eager_fp16_max_abs_ddist"] = float(np.abs(dists["compiled"] - dists["eager"]).max())
    print(json.dumps(out), flush=True)
    return out


def one_ulp(comp: V2Compute) -> V2Compute:
    """comp with one element of every nonce's bf16 input (middle position, column 7) moved up by one ulp."""
    inputs = comp._inputs

    def perturbed(seeds, seq_len, dim, keys):
        x = inputs(seeds, seq_len, dim, keys).to(comp.dtype)
        col = x[:, seq_len // 2, 7].clone()
        x[:, seq_len // 2, 7] = (col.view(torch.int16) + 1).view(x.dtype)  # the next bf16 away from zero
        return x

    comp._inputs = perturbed
    return comp


def profile(name: str, batch: int, compile: bool, sw: Switches, warm: int = 3, steps: int = 4) -> dict:
    """Where the time of one workload goes: CUDA kernel time by kind (torch.profiler) against wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from poc.profiling import breakdown

    w = WORKLOADS[name]
    dtype = DTYPES[w["dtype"]]
    cfg = workload_config(w)
    opts = sw.options
    engine = make_engine("cuda", replicas=1, compile=compile, options=opts)
    model = random_v2_model(cfg, dtype, "cuda", w.get("fp8", False), w, replace(opts, compiled=compile))
    cfg = model.cfg
    engine.v2 = V2Compute(model, cfg, dtype, torch.device("cuda"), w["model"], compile=compile)
    job = V2Job(BH, PK, 1, w["seq_len"], 12, v1.worker_nonces(0, 0, 1), batch)
    job.limits = Limits(max_nonces=batch * warm, max_duration=None)
    engine.run(job, lambda b: None, threading.Event())  # compile + warm up
    job = V2Job(BH, PK, 1, w["seq_len"], 12, v1.worker_nonces(0, 0, 1), batch)
    job.limits = Limits(max_nonces=batch * steps, max_duration=None)
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.run(job, lambda b: None, threading.Event())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    b = breakdown(prof, wall, top_n=30)
    kinds = b["by_kind_s"]
    fl = flops_per_nonce(cfg, w["seq_len"], False) * batch * steps
    out = {"workload": name, "batch": batch, "compile": compile, **b,
           "gemm_tflops": None, "nonces_per_s": batch * steps / wall}
    # the GEMM share of the FLOPs (everything but attention) over the GEMM kernels' time
    attn_fl = 2.0 * cfg.n_layers * w["seq_len"] ** 2 * cfg.n_heads * cfg.head_dim * batch * steps
    if kinds["gemm"]:
        out["gemm_tflops"] = (fl - attn_fl) / kinds["gemm"] / 1e12
    if kinds["attention"]:
        out["attention_tflops"] = attn_fl / kinds["attention"] / 1e12
    print(json.dumps(out, indent=1), flush=True)
    engine.close()
    return out


def command(argv: list[str] | None, program: str = "python -m poc.bench") -> str:
    """The command line of this run (`program` and argv, default this process's arguments), prefixed with the POC_*
    and TORCHINDUCTOR_* settings it ran under (not TORCHINDUCTOR_CACHE_DIR, which importing inductor sets and which
    changes no result)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith(("POC_", "TORCHINDUCTOR_")) and k != "TORCHINDUCTOR_CACHE_DIR"]
    return " ".join([*env, program, shlex.join(argv if argv is not None else sys.argv[1:])]).rstrip()


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), or None (said once) where matplotlib is missing:
    the benchmarks' and diagnostics' plots are optional."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    """A diagnostic's figure laid out and written to `path` (110 dpi), said on stdout."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def redraw(result: str | Path, plot) -> None:
    """`plot` drawn again from a result file, beside it (`x.json` -> `x.png`): a diagnostic's --plot."""
    result = Path(result)
    plot(json.loads(result.read_text()), result.with_suffix(".png"))


def write_result(out: str | Path, script: str, argv: list[str] | None, result: dict, plot=None, **meta) -> Path:
    """A benchmark diagnostic's result as JSON at `out` (its folder made): "command" (`python SCRIPT` and the
    arguments, `argv` or this process's, after the settings it ran under: `command`), "date", then `meta` (the
    device, versions, settings) and `result`; then `plot(everything, out.png)` where given. Returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"command": command(argv, f"python {script}"), "date": time.strftime("%Y-%m-%d %H:%M:%S"), **meta,
            **result}
    out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {out}")
    if plot is not None:
        plot(body, out.with_suffix(".png"))
    return out


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = sorted({r["workload"] for r in results["rows"]})
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, n in zip(axes[0], names):
        ours = [r for r in results["rows"] if r["workload"] == n and "impl" not in r and "nonces_per_s" in r]
        hf = [r for r in results["rows"] if r["workload"] == n and r.get("impl") and "nonces_per_s" in r]
        if ours:
            ax.plot([r["batch"] for r in ours], [r["nonces_per_s"] for r in ours], "o-", label="poc engine (e2e)")
            ax.axhline(ours[0]["flop_limit_nonces_per_s"], color="r", ls="--", label="FLOP limit")
        if hf:
            ax.plot([r["batch"] for r in hf], [r["nonces_per_s"] for r in hf], "s--", label="transformers fwd")
        ax.set_xscale("log", base=2)
        ax.set_title(n)
        ax.set_xlabel("batch size")
        ax.set_ylabel("nonces/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{results['device']} (matmul ceiling {results['ceiling_tflops']:.0f} TFLOP/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> None:
    from poc import __version__

    ap = argparse.ArgumentParser(prog="python -m poc.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=f"poc.bench {__version__}")
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--batch", nargs="+", type=int, help="batch sizes (default: per workload)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the batch function")
    ap.add_argument("--hf", action="store_true", help="also time the transformers forward (W3-W5)")
    ap.add_argument("--warm", type=int, default=2, help="batches before timing")
    ap.add_argument("--timed", type=int, default=6, help="timed batches")
    ap.add_argument("--out", default="benchmarks/bench.json")
    ap.add_argument("--check", action="store_true", help="only compare the compiled path with eager")
    ap.add_argument("--profile", action="store_true", help="only profile the first workload at the first batch size")
    args = ap.parse_args(argv)
    if args.batch and min(args.batch) < 1:
        ap.error(f"--batch sizes must be >= 1, got {min(args.batch)}")
    if args.warm < 0 or args.timed < 1:
        ap.error(f"--warm must be >= 0 and --timed >= 1, got {args.warm} and {args.timed}")
    # the environment's switches, read once here: the server's (README's Configuration table) and the bench's own
    # POC_COMPILE_INPUTS (1, default: the v2 input generator compiled with the model; 0: eager inputs)
    try:
        sw = Switches.from_env(os.environ)
    except InputError as e:
        ap.error(str(e))
    compile_inputs = os.environ.get("POC_COMPILE_INPUTS", "1").strip()
    if compile_inputs not in ("0", "1"):
        ap.error(f"POC_COMPILE_INPUTS must be 0 or 1, got {compile_inputs!r}")
    _import_heavy()
    if not torch.cuda.is_available():
        raise SystemExit("poc.bench needs a CUDA GPU (none is visible here): nothing was run; "
                         "on a CPU, the test suite checks the same engine")
    torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.profile:
        name = args.workload[0]
        result = profile(name, (args.batch or WORKLOADS[name]["batches"])[0], args.compile, sw)
        out.write_text(json.dumps({**result, "command": command(argv)}, indent=1))
        return
    if args.check:
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "accuracy": check_accuracy(),
                                   "command": command(argv)}, indent=1))
        return
    ceil = {"bfloat16": matmul_ceiling(torch.bfloat16), "float16": matmul_ceiling(torch.float16)}
    print(f"matmul ceiling: bf16 {ceil['bfloat16']:.0f} TFLOP/s, fp16 {ceil['float16']:.0f} TFLOP/s", flush=True)
    rows = []
    for name in args.workload:
        w = WORKLOADS[name]
        rows += bench_workload(name, args.batch or w["batches"], args.compile, args.hf, ceil[w["dtype"]],
                               args.warm, args.timed, sw, compile_inputs == "1")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
               "ceiling_tflops": ceil["bfloat16"], "ceilings": ceil, "command": command(argv), "rows": rows,
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
