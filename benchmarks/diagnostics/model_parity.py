"""Max |ours - transformers| for each case of the parity tests (tests/test_model_parity.py, its checkpoints from
tests/checkpoints.py), on the CPU in float32.

    PYTHONPATH=src:. python benchmarks/diagnostics/model_parity.py [--out benchmarks/cpu/model_parity.json]

For each case (LLaMA GQA/MHA/llama3 rope scaling, Qwen2 with biases, Qwen3 GQA/MHA; batch 3, seq 11, 3 layers,
weights scaled so that attention is far from uniform): the final-norm hidden states, the logits, and the hidden
states with a reflection after every layer (transformers' side through forward hooks), which the tests hold under
1e-5; for scale, the largest output and how much the reflections move it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


import transformers  # noqa: E402

from poc.model.weights import load_model  # noqa: E402
from tests.checkpoints import DENSE_CASES, make_hf, unit_rows  # noqa: E402
from tests.parity import hooked_hf_forward  # noqa: E402


@torch.no_grad()
def case(name: str) -> dict:
    family, overrides = DENSE_CASES[name]
    with tempfile.TemporaryDirectory() as d:
        hf = make_hf(Path(d), family, **overrides)
        ours, cfg = load_model(Path(d), dtype=torch.float32, with_head=True, progress=False)
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1))
    vs = unit_rows(cfg.n_layers, cfg.dim)
    plain, reflected = ours(x, last_only=False), ours(x, reflections=vs, last_only=False)
    return {
        "max_abs_output": plain.abs().max().item(),
        "reflections_change_max_abs": (reflected - plain).abs().max().item(),
        "final_norm_hidden": (ours(x, last_only=False) - hf.model(inputs_embeds=x).last_hidden_state).abs().max().item(),
        "logits": (ours(x, last_only=False, logits=True) - hf(inputs_embeds=x).logits.float()).abs().max().item(),
        "with_reflections": (ours(x, reflections=vs, last_only=False)
                             - hooked_hf_forward(hf, vs, x)).abs().max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/cpu/model_parity.json")
    args = ap.parse_args()
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "device": "cpu",
           "max_abs_diff": {}}
    for name in sorted(DENSE_CASES):
        out["max_abs_diff"][name] = case(name)
        print(name, json.dumps({k: f"{v:.1e}" for k, v in out["max_abs_diff"][name].items()}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
