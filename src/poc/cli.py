"""Offline PoC computation, for debugging a validator mismatch and for our own checks.

    python -m poc v1 --params '{"dim": 64, ...}' --block-hash H --public-key K --nonces 0-15 [--dtype float16] [--device cpu]
    python -m poc v2 --model DIR --block-hash H --public-key K --nonces 0,3,9 --seq-len 16 [--k-dim 12] [--stronger-rng]

Both take [--tp N] [--pp M] [--replicas R] (env POC_TP, POC_PP, POC_REPLICAS): more than one device runs in
rank processes (poc.engine.dist); on CUDA every visible GPU is used unless --replicas caps it. The model's and the
ranks' switches are the server's environment variables (POC_FP8, POC_FP8_SCALES, POC_FP8_EXPERTS, POC_TP_REDUCE,
POC_POOL_WORKERS, ...: README's Configuration table), read here once (ModelOptions.from_env, RankDiagnostics.from_env).

One JSON line per nonce on stdout. Bad input: one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

from poc import dtypes
from poc.errors import InputError
from poc.protocol.nonces import MAX_NONCE

MAX_CLI_NONCES = 1_000_000


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too)
        raise InputError(message)


def parse_nonces(text: str) -> list[int]:
    """"a-b" (inclusive) or "a,b,c"; non-negative integers."""
    text = text.strip()
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        if b < a:
            raise InputError(f"--nonces range {text!r} ends before it starts", "nonces")
        if b > MAX_NONCE:
            raise InputError(f"--nonces: {b} is over the int64 range", "nonces")
        if b - a + 1 > MAX_CLI_NONCES:
            raise InputError(f"--nonces range {text!r} has more than {MAX_CLI_NONCES} nonces", "nonces")
        return list(range(a, b + 1))
    out = []
    for part in text.split(","):
        part = part.strip()
        if not re.fullmatch(r"-?\d+", part):
            raise InputError(f"--nonces: {part!r} is not an integer (use a-b or a,b,c)", "nonces")
        n = int(part)
        if n < 0:
            raise InputError(f"--nonces: {n} is negative", "nonces")
        if n > MAX_NONCE:
            raise InputError(f"--nonces: {n} is over the int64 range", "nonces")
        out.append(n)
    return out


def _parser() -> argparse.ArgumentParser:
    from poc import __version__

    ap = _Parser(prog="python -m poc", description="Compute PoC v1 distances or v2 artifacts offline.")
    ap.add_argument("--version", action="version", version=f"poc {__version__}")
    sub = ap.add_subparsers(dest="protocol", required=True, parser_class=_Parser)
    for name in ("v1", "v2"):
        p = sub.add_parser(name)
        p.add_argument("--block-hash", required=True)
        p.add_argument("--public-key", required=True)
        p.add_argument("--nonces", required=True, help="a-b (inclusive) or a,b,c")
        p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
        p.add_argument("--batch-size", type=int, default=32)
        p.add_argument("--tp", type=int, default=os.environ.get("POC_TP", "1"), help="tensor-parallel ranks")
        p.add_argument("--pp", type=int, default=os.environ.get("POC_PP", "1"), help="pipeline stages")
        p.add_argument("--replicas", type=int, default=os.environ.get("POC_REPLICAS") or None,
                       help="independent tp x pp groups (default: 1 on CPU, every GPU on CUDA)")
        if name == "v1":
            p.add_argument("--params", required=True, help="the params JSON object (every key required)")
            p.add_argument("--dtype", default="float16", choices=list(dtypes.NAMES),
                           help="float16 is what validators run")
        else:
            p.add_argument("--model", required=True,
                           help="a Hugging Face checkpoint directory, or a repo id in the local Hugging Face cache")
            p.add_argument("--seq-len", type=int, required=True)
            p.add_argument("--k-dim", type=int, default=12)
            p.add_argument("--stronger-rng", action="store_true")
            p.add_argument("--dtype", default="auto", choices=["auto", *dtypes.NAMES],
                           help="auto: the checkpoint's dtype on CUDA, float32 on CPU")
    return ap


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    nonces = parse_nonces(args.nonces)
    if args.batch_size <= 0:
        raise InputError(f"--batch-size must be positive, got {args.batch_size}", "batch_size")
    for flag in ("tp", "pp", "replicas"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise InputError(f"--{flag} must be positive, got {getattr(args, flag)}", flag)
    from poc.model.options import ModelOptions
    from poc.engine.rankgroup import RankDiagnostics

    par = dict(tp=args.tp, pp=args.pp, replicas=args.replicas, options=ModelOptions.from_env(os.environ),
               diagnostics=RankDiagnostics.from_env(os.environ))
    # torch (via poc.engine.factory) is imported only after every check that needs no device: a bad argument is
    # answered in well under a second (tests/test_ops.py checks the imports, scripts/startup_time.py the time)

    if args.protocol == "v1":
        from poc.protocol.v1 import V1Params

        try:
            obj = json.loads(args.params)
        except json.JSONDecodeError as e:
            raise InputError(f"--params is not valid JSON: {e}", "params") from None
        params = V1Params.from_json(obj)
        from poc.engine.factory import make_engine

        engine = make_engine(args.device, **par)
        try:
            # the server's estimate (a 422 there): params far too large are refused here, not half-allocated
            engine.check_v1_memory(params, min(args.batch_size, len(nonces)), args.dtype)
            dists = engine.v1_distances(params, args.block_hash, args.public_key, nonces, args.dtype, args.batch_size)
        finally:
            engine.close()
        for n, d in zip(nonces, dists):
            print(json.dumps({"nonce": n, "dist": float(d)}), flush=False)
    else:
        if args.seq_len <= 0:
            raise InputError(f"--seq-len must be positive, got {args.seq_len}", "seq_len")
        from pathlib import Path

        from poc.hub import resolve_model
        from poc.model.config import ModelConfig

        args.model = resolve_model(args.model)  # a Hugging Face repo id: its snapshot in the local cache, offline
        if not Path(args.model).is_dir():
            raise InputError(f"model directory {args.model} does not exist", "model")
        cfg = ModelConfig.from_hf(args.model)  # config.json only: bad flags fail before any loading
        hidden = cfg.dim
        if args.seq_len > cfg.max_seq_len:
            raise InputError(f"--seq-len must be <= {cfg.max_seq_len} (the model's max_position_embeddings), got "
                             f"{args.seq_len}", "seq_len")
        if not 1 <= args.k_dim <= hidden:
            raise InputError(f"--k-dim must be in [1, {hidden}] (the model's hidden size), got {args.k_dim}", "k_dim")
        from poc.engine.factory import make_engine

        engine = make_engine(args.device, model_dir=args.model, dtype=args.dtype, **par)
        try:
            engine.load()
            arts, dropped = engine.v2_artifacts(args.block_hash, args.public_key, nonces, args.seq_len, args.k_dim,
                                                args.stronger_rng, args.batch_size)
        finally:
            engine.close()
        by_nonce = {a["nonce"]: a["vector_b64"] for a in arts}
        for n in nonces:
            if n in by_nonce:
                print(json.dumps({"nonce": n, "vector_b64": by_nonce[n]}))
            else:
                print(json.dumps({"nonce": n, "error": "non-finite output (NaN/Inf): no artifact"}))
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except InputError as e:
        print(f"poc: bad input: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # python -m poc.cli works as python -m poc does
    sys.exit(main())
