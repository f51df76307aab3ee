"""How close our MiniMax-M2.7 artifacts are to the H100 validators' recipe, on one GPU, on random weights of the real
shape (random:minimax-m2.7:fp8): the first few layers, and all 62.

    PYTHONPATH=src:. python benchmarks/diagnostics/minimax_accuracy.py --out benchmarks/h100/minimax_accuracy.json
    bash benchmarks/run.sh h100 minimax_accuracy            # the same through the suite

Ours is the served path (W8A8 with UE8M0 scales, the validators' FP8 attention kernel, the float32 router, compiled
as the server runs): a model that does not fit the GPU runs as pipeline stages one after the other (each stage built,
run over every nonce, freed), as pp=N ranks would run it. The reference is tests/minimax_spec.py, a float32
emulation of ../shared/spec/minimax-m2.md's recipe written independently of src/poc/model, fed the checkpoint the
random draws make (random_weights.checkpoint_layer: FP8 weights with their float32 block scales, re-quantised to
UE8M0 by the emulation itself), one layer at a time. Distances are the validators' own: L2 between the decoded fp16
artifacts (mean, p98, max, and the share above the chain's dist_threshold 0.75 for this model).

Rows, per depth:
- ours vs the spec emulation (one GPU's arithmetic: no tensor-parallel partial sums): the number to watch, and ours
  against the emulation of the H100 validators (TP4: o_proj's and the experts' bf16 partial sums all-reduced) and of
  the H200 validators (TP2);
- honest noise: the H100 validators against the H200 validators (TP4 vs TP2 emulations: the same recipe, two
  deployments the chain accepts), the emulation with every GEMM summed exactly (float64: without float32's
  accumulation order) against the emulation, and ours at another batch size;
- the router's GEMM: ours (the float32 gate as three bfloat16 parts on the tensor cores, ModelOptions.router_gemm
  split) against ours with the float32 FFMA GEMM;
- each recipe variant's emulation against the spec's: the vLLM 0.20-era attention (bf16 Q, e4m3 K/V), bf16
  attention, a bf16 router, float32 scales, transformers' expert weighing (each a way to be systematically wrong),
  and ours against each.
A systematic error shows as a distance far above the honest noise. JSON (the command inside) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from poc.bench import pyplot
from poc.model.compile import maybe_compile
from poc.model.config import PRESETS
from poc.model.options import ModelOptions
from poc.model.random_weights import checkpoint_norm, random_model
from poc.model.transformer import Transformer
from poc.parallel.build import Part
from poc.parallel.layout import stage_layers
from poc.protocol import v2
from tests.checkpoints import random_layers
from tests.minimax_spec import Emulation, Recipe, rope_tables

BH, PK = "minimax-accuracy", "bench-key"
K_DIM = 12
THRESHOLD = 0.75  # MiniMax-M2.7's dist_threshold on the chain
VARIANTS = {"attention 0.20 (bf16 Q, e4m3 K/V)": Recipe(attention="fp8kv"), "attention bf16": Recipe(attention="bf16"),
            "router bf16": Recipe(router="bf16"), "scales float32": Recipe(scales="float32"),
            "weights as transformers": Recipe(weight_in_down=False)}


def stages_for(cfg, device) -> int:
    """The fewest pipeline stages whose largest fits this GPU (weights ~3.7 GB a layer, 16 GB kept for a batch)."""
    if device.type != "cuda":
        return 1
    per_layer = 3 * cfg.dim * cfg.moe_ffn_dim * cfg.n_experts * 1.0003 + 4 * cfg.dim * cfg.n_heads * cfg.head_dim
    room = torch.cuda.get_device_properties(device).total_memory - 16e9
    n = 1
    while max(len(r) for r in stage_layers(cfg.n_layers, n)) * per_layer > room:
        n += 1
    return n


def plan(nonces: list[int], dim: int, dev):
    p = v2.plan(BH, PK, nonces, dim, K_DIM, dev)
    seeds = v2.input_seeds(BH, PK, nonces).to(dev)
    return seeds, p.pick, p.haar


def vectors(nonces: list[int], out: torch.Tensor, pick, haar) -> dict[int, np.ndarray]:
    arts, _ = v2.artifacts(nonces, v2.project_tensors(out, pick, haar).cpu())
    return {a["nonce"]: v2.decode(a["vector_b64"]) for a in arts}


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def ours(cfg, nonces: list[int], batch: int, dev, compile: bool, options: ModelOptions | None = None
         ) -> tuple[dict, float]:
    """The served forward, stage after stage when the model does not fit: (vectors, nonces/s of the forward).
    options: the served defaults, or another setting (the float32 FFMA router)."""
    n_stages = stages_for(cfg, dev)
    step = maybe_compile(Transformer.layer_step, compile)
    keys = v2.hash_keys(SEQ * cfg.dim, dev)
    refl = v2.layer_vectors(BH, cfg.n_layers, cfg.dim, dev).to(torch.bfloat16)
    h = {}
    t = 0.0
    for s in range(n_stages):
        model = random_model(cfg, torch.bfloat16, dev, fp8_ckpt=True, shard=Part(stage=s, n_stages=n_stages).shard,
                             options=options)
        for i in range(0, len(nonces), batch):
            part = nonces[i:i + batch]
            seeds, pick, haar = plan(part, cfg.dim, dev)
            x = v2.inputs_from_seeds(seeds, SEQ, cfg.dim, keys).to(torch.bfloat16) if s == 0 else h[i].to(dev)
            sync(dev)
            t0 = time.perf_counter()
            y = model(x, reflections=refl, last_only=True, step=step)
            sync(dev)
            t += time.perf_counter() - t0 if i else 0.0  # the first batch compiles
            h[i] = y if s == n_stages - 1 else y.cpu()
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = {}
    for i in range(0, len(nonces), batch):
        part = nonces[i:i + batch]
        _, pick, haar = plan(part, cfg.dim, dev)
        out.update(vectors(part, h[i], pick, haar))
    timed = len(nonces) - min(batch, len(nonces))
    return out, (timed / t if t else float("nan"))


@torch.no_grad()
def emulations(cfg, recipes: dict[str, tuple[Recipe, bool]], nonces: list[int], batch: int, dev,
               state_bytes: float = 24e9) -> dict:
    """Each recipe's (Recipe, exact) float32 emulation over the nonces. Layer by layer over as many nonces as their
    states (hidden and residual, bf16 values) fit in state_bytes: one layer's weights drawn once (as random_model
    draws them, under the release's names) for every batch and recipe."""
    final = checkpoint_norm(cfg, torch.bfloat16, dev)
    keys = v2.hash_keys(SEQ * cfg.dim, dev)
    refl = v2.layer_vectors(BH, cfg.n_layers, cfg.dim, dev).to(torch.bfloat16)
    cos, sin = (t.to(dev) for t in rope_tables(SEQ, cfg.rope_dim, cfg.rope_theta))
    cache: dict = {}
    experts: dict = {}  # the layer's experts dequantised once, for every batch and recipe

    draw = random_layers(cfg, torch.bfloat16, dev)

    def weights(i: int) -> dict:
        if i not in cache:
            cache.clear()
            experts.clear()
            cache[i] = draw(i)
        return cache[i]

    emus = {name: Emulation(cfg, weights, final, r, exact=exact, cache=experts)
            for name, (r, exact) in recipes.items()}
    out = {name: {} for name in recipes}
    per_nonce = 2 * SEQ * cfg.dim * 2 * len(emus)
    chunk = max(batch, int(state_bytes // per_nonce) // batch * batch)
    for c0 in range(0, len(nonces), chunk):
        batches = [nonces[i:i + batch] for i in range(c0, min(len(nonces), c0 + chunk), batch)]
        state = {}
        for b, part in enumerate(batches):
            seeds, _, _ = plan(part, cfg.dim, dev)
            x = v2.inputs_from_seeds(seeds, SEQ, cfg.dim, keys).to(torch.bfloat16)
            for name in emus:
                state[name, b] = (x, None)
        for layer in range(cfg.n_layers):
            v = refl[layer].float()
            for b in range(len(batches)):
                for name, e in emus.items():
                    h, r = state[name, b]
                    h, r = e.layer(layer, h.float(), None if r is None else r.float(), cos, sin)
                    state[name, b] = (e.reflect(h, v).to(torch.bfloat16), e.reflect(r, v).to(torch.bfloat16))
        cache.clear()
        experts.clear()
        for b, part in enumerate(batches):
            _, pick, haar = plan(part, cfg.dim, dev)
            for name, e in emus.items():
                h, r = state.pop((name, b))
                final_h = e.norm(e.rnd(h.float() + r.float()), final)[:, -1]
                out[name].update(vectors(part, final_h.to(torch.bfloat16), pick, haar))
    return out


def dist(a: dict, b: dict) -> dict:
    d = np.array([float(np.linalg.norm(a[n] - b[n])) for n in sorted(a)])
    return {"mean": float(d.mean()), "p98": float(np.percentile(d, 98)), "max": float(d.max()),
            "above_threshold": float((d > THRESHOLD).mean()), "n": int(d.size)}


def recipes_at(args, layers: int) -> dict[str, tuple[Recipe, bool]]:
    recipes = {"spec": (Recipe(), False), "spec TP4": (Recipe(tp=4), False), "spec TP2": (Recipe(tp=2), False)}
    if layers <= args.variants_up_to:
        recipes["spec, exact GEMM sums"] = (Recipe(), True)
        recipes.update({k: (r, False) for k, r in VARIANTS.items()})
    return recipes


def compute(args, layers: int, n: int, dev, names: list[str]) -> tuple[dict, dict]:
    """The artifacts of each named run ("ours", "ours half": ours at half the batch, or a recipe of recipes_at) over
    nonces 0..n-1 at this depth, and the seconds each kind took."""
    cfg = replace(PRESETS[args.preset], n_layers=layers, fp8_block=(128, 128))
    nonces = list(range(n))
    compile = args.compile and dev.type == "cuda"
    out, info = {}, {"seconds_ours": 0.0, "seconds_emulation": 0.0}
    t0 = time.perf_counter()
    if "ours" in names:
        out["ours"], info["ours_forward_nonces_per_s"] = ours(cfg, nonces, args.batch, dev, compile)
    if "ours half" in names:
        out["ours half"] = ours(cfg, nonces, args.batch // 2, dev, compile)[0]
    if "ours router float32" in names:
        out["ours router float32"] = ours(cfg, nonces, args.batch, dev, compile, ModelOptions(router_gemm="float32"))[0]
    info["seconds_ours"] = time.perf_counter() - t0
    recipes = {k: r for k, r in recipes_at(args, layers).items() if k in names}
    t0 = time.perf_counter()
    if recipes:
        out.update(emulations(cfg, recipes, nonces, args.emu_batch, dev))
    info["seconds_emulation"] = time.perf_counter() - t0
    return out, info


def compute_on_gpus(args, layers: int, n: int, names: list[str], argv: list[str]) -> tuple[dict, dict]:
    """compute() split over args.gpus processes, one GPU each (CUDA_VISIBLE_DEVICES): ours alone on the first,
    the recipes dealt over the others; the results merged. Each process draws the layers' weights itself (the
    draws are seeded: every GPU draws the same)."""
    groups = [["ours", "ours half", "ours router float32"]] + [[] for _ in range(args.gpus - 1)]
    for i, name in enumerate(k for k in names if not k.startswith("ours")):
        groups[1 + i % (args.gpus - 1)].append(name)
    groups = [[k for k in g if k in names] for g in groups]
    procs = []
    with tempfile.TemporaryDirectory(prefix="minimax-accuracy-") as tmp:
        for gpu, group in enumerate(groups):
            if not group:
                continue
            path = Path(tmp) / f"gpu{gpu}.pkl"
            cmd = [sys.executable, __file__, *argv, "--gpus", "1", "--worker",
                   json.dumps({"layers": layers, "n": n, "names": group, "out": str(path)})]
            procs.append((subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}), path))
        failed = [p.args for p, _ in procs if p.wait()]
        if failed:
            raise RuntimeError(f"{len(failed)} worker(s) failed: {failed}")
        out, info = {}, {"seconds_ours": 0.0, "seconds_emulation": 0.0}
        for _, path in procs:
            part, part_info = pickle.loads(path.read_bytes())
            out.update(part)
            for k, v in part_info.items():  # the slowest process's seconds: they ran side by side
                info[k] = max(info.get(k, 0.0), v)
    return out, info


def depth(args, layers: int, n: int, dev, argv: list[str]) -> dict:
    names = ["ours"] + (["ours half", "ours router float32"] if layers <= args.variants_up_to else []) + list(
        recipes_at(args, layers))
    if args.gpus > 1:
        emu, info = compute_on_gpus(args, layers, n, names, argv)
    else:
        emu, info = compute(args, layers, n, dev, names)
    mine, other_batch, ffma = emu.pop("ours"), emu.pop("ours half", None), emu.pop("ours router float32", None)
    rate, t_ours, t_emu = info.get("ours_forward_nonces_per_s"), info["seconds_ours"], info["seconds_emulation"]
    spec = emu["spec"]
    rows = [{"compare": "ours vs spec emulation", **dist(mine, spec)},
            {"compare": "ours vs spec TP4 (H100 validators)", **dist(mine, emu["spec TP4"])},
            {"compare": "ours vs spec TP2 (H200 validators)", **dist(mine, emu["spec TP2"])},
            {"compare": "honest: spec TP4 vs TP2 (H100 vs H200 validators)", **dist(emu["spec TP4"], emu["spec TP2"])},
            {"compare": "honest: spec TP4 vs one GPU", **dist(emu["spec TP4"], spec)}]
    if "spec, exact GEMM sums" in emu:
        rows.append({"compare": "honest: emulation exact GEMM sums vs spec", **dist(emu["spec, exact GEMM sums"], spec)})
    if other_batch is not None:
        rows.append({"compare": "honest: ours batch %d vs %d" % (args.batch, args.batch // 2),
                     **dist(mine, other_batch)})
    if ffma is not None:
        rows.append({"compare": "router GEMM: ours (split) vs ours with the float32 FFMA GEMM", **dist(mine, ffma)})
    for k in VARIANTS:
        if k in emu:
            rows.append({"compare": f"variant: {k} vs spec", **dist(emu[k], spec)})
            rows.append({"compare": f"ours vs variant {k}", **dist(mine, emu[k])})
    for r in rows:
        print(f"  {layers:2d} layers  {r['compare']:52s} mean {r['mean']:.4f}  p98 {r['p98']:.4f}  "
              f"max {r['max']:.4f}  >0.75 {r['above_threshold']:.3f}", flush=True)
    return {"layers": layers, "nonces": n, "ours_forward_nonces_per_s": rate, "seconds_ours": t_ours,
            "seconds_emulation": t_emu, "rows": rows}


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(res["depths"]), figsize=(7 * len(res["depths"]), 6), squeeze=False)
    for ax, d in zip(axes[0], res["depths"]):
        names = [r["compare"] for r in d["rows"]]
        ax.barh(range(len(names)), [max(r["mean"], 1e-6) for r in d["rows"]], color=[
            "tab:green" if n.startswith("ours vs spec") else "tab:gray" if n.startswith("honest") else
            "tab:blue" if n.startswith("router GEMM") else "tab:red"
            for n in names])
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xscale("log")
        ax.axvline(THRESHOLD, color="k", ls="--", lw=0.8)
        ax.set_xlabel("mean L2 of the fp16 artifacts")
        ax.set_title(f"MiniMax-M2.7 shape, {d['layers']} layers, {d['nonces']} nonces")
        ax.invert_yaxis()
    fig.suptitle(res["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/h100/minimax_accuracy.json")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 62])
    ap.add_argument("--nonces", type=int, nargs="+", default=[256, 64], help="per depth")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--emu-batch", type=int, default=8)
    ap.add_argument("--variants-up-to", type=int, default=8,
                    help="the recipe variants and ours at a second batch size at depths up to this")
    ap.add_argument("--eager", dest="compile", action="store_false")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--preset", default="minimax-m2.7", help="tiny-minimax with --device cpu: a smoke run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpus", type=int, default=1,
                    help="processes on this many GPUs side by side (ours on the first, the recipes on the others)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # compute_on_gpus' processes
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    global SEQ
    SEQ = args.seq
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulation's float32 GEMMs are true float32
    dev = torch.device(args.device)
    if args.worker:
        job = json.loads(args.worker)
        Path(job["out"]).write_bytes(pickle.dumps(compute(args, job["layers"], job["n"], dev, job["names"])))
        return
    parent_argv = [a for i, a in enumerate(argv) if a != "--gpus" and (i == 0 or argv[i - 1] != "--gpus")]
    res = {"command": "PYTHONPATH=src:. python benchmarks/diagnostics/minimax_accuracy.py "
                      + shlex.join(argv),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "gpus": args.gpus,
           "torch": torch.__version__,
           "compile": args.compile and dev.type == "cuda",
           "model": f"random:{args.preset}:fp8 (W8A8, UE8M0, FP8 attention)", "seq_len": SEQ, "k_dim": K_DIM,
           "depths": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for layers, n in zip(args.layers, args.nonces):
        res["depths"].append(depth(args, layers, n, dev, parent_argv))
        out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
