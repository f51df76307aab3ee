"""`python -m poc`: golden numbers out, and every bad input is exit code 2 with one line, never a traceback."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from poc.protocol import v2

from .golden import ROOT, V1_GOLDEN as G1, V2_GOLDEN as G2, v2_checkpoint

BH, PK = G1["block_hash"], G1["public_key"]
PARAMS_A = G1["sets"]["A_gqa_plain_rope"]["params"]


def cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "poc", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def v1_args(params=PARAMS_A, nonces="0-15", *extra):
    p = params if isinstance(params, str) else json.dumps(params)
    return ["v1", "--params", p, "--block-hash", BH, "--public-key", PK, "--nonces", nonces, *extra]


def v2_args(model=None, nonces="0,3,7", *extra):
    return ["v2", "--model", str(model or v2_checkpoint("qwen3")), "--block-hash", BH, "--public-key", PK,
            "--nonces", nonces, "--seq-len", "16", *extra]


def test_v1_golden_float32():
    r = cli(*v1_args(PARAMS_A, "0-15", "--dtype", "float32"))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["nonce"] for x in rows] == list(range(16))
    want = G1["sets"]["A_gqa_plain_rope"]["runs"]["float32"]["dist"]
    assert np.abs(np.array([x["dist"] for x in rows]) - want).max() < 1e-6


def test_v2_golden_and_stronger_rng():
    for extra, key in (((), "artifacts"), (("--stronger-rng",), "artifacts_stronger_rng")):
        r = cli(*v2_args(None, "0,3,7", *extra))
        assert r.returncode == 0, r.stderr
        rows = {x["nonce"]: x["vector_b64"] for x in map(json.loads, r.stdout.splitlines())}
        want = {a["nonce"]: a["vector_f32_from_f16"] for a in G2["models"]["qwen3"][key]}
        assert sorted(rows) == [0, 3, 7]
        for n, b64 in rows.items():
            assert np.linalg.norm(v2.decode(b64) - np.array(want[n], np.float32)) < 1e-3


def _bad_checkpoints(tmp_path):
    src = v2_checkpoint("qwen3")
    out = {}
    for name in ("truncated", "corrupt", "arch"):
        d = tmp_path / name
        shutil.copytree(src, d)
        out[name] = d
    st = out["truncated"] / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    (out["corrupt"] / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    cfg = json.loads((out["arch"] / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (out["arch"] / "config.json").write_text(json.dumps(cfg))
    out["missing"] = tmp_path / "no-such-dir"
    return out


@pytest.mark.parametrize("case", [
    "unknown_key", "mistyped_key", "missing_seq_len", "not_json", "nonce_text", "nonce_float", "k_dim_0",
    "k_dim_big", "seq_len_0", "missing_model", "truncated", "corrupt", "arch", "unknown_flag", "no_protocol",
    "device_unknown", "device_meta", "nonce_over_int64", "params_overflow", "params_too_big", "seq_len_big"])
def test_bad_input_exit_2_one_line(case, tmp_path):
    bad = _bad_checkpoints(tmp_path) if case in ("missing_model", "truncated", "corrupt", "arch") else {}
    args = {
        "unknown_key": v1_args({**PARAMS_A, "dimm": 64}),
        "mistyped_key": v1_args({**PARAMS_A, "n_layers": "2"}),
        "missing_seq_len": v1_args({k: v for k, v in PARAMS_A.items() if k != "seq_len"}),
        "not_json": v1_args("{dim: 64"),
        "nonce_text": v1_args(PARAMS_A, "0,x,2"),
        "nonce_float": v1_args(PARAMS_A, "1.5"),
        "k_dim_0": v2_args(None, "0", "--k-dim", "0"),
        "k_dim_big": v2_args(None, "0", "--k-dim", "65"),
        "seq_len_0": v2_args(None, "0")[:-1] + ["0"],
        "missing_model": v2_args(bad.get("missing")),
        "truncated": v2_args(bad.get("truncated")),
        "corrupt": v2_args(bad.get("corrupt")),
        "arch": v2_args(bad.get("arch")),
        "unknown_flag": v1_args(PARAMS_A, "0", "--bogus"),
        "no_protocol": ["v3"],
        "device_unknown": v1_args(PARAMS_A, "0", "--device", "tpu"),
        "device_meta": v1_args(PARAMS_A, "0", "--device", "meta"),
        "nonce_over_int64": v1_args(PARAMS_A, str(2**70)),
        "params_overflow": v1_args({**PARAMS_A, "norm_eps": 10**400}, "0"),
        "params_too_big": v1_args({**PARAMS_A, "dim": 10**6, "n_heads": 1, "n_kv_heads": 1}, "0"),
        "seq_len_big": v2_args(None, "0")[:-1] + [str(2**70)],
    }[case]
    r = cli(*args)
    assert r.returncode == 2, (case, r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("poc: bad input: "), (case, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    if case in ("missing_seq_len", "unknown_key", "mistyped_key"):
        assert {"missing_seq_len": "seq_len", "unknown_key": "dimm", "mistyped_key": "n_layers"}[case] in lines[0]


def test_module_cli_runs_as_a_script():
    """`python -m poc.cli --help` prints the usage (it printed nothing: the module had no __main__ guard)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-m", "poc.cli", "--help"], capture_output=True, text=True, timeout=60,
                       env=env, cwd=ROOT)
    assert r.returncode == 0 and "usage: python -m poc" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("args, rc, words", [
    (["--batch", "0"], 2, "--batch sizes must be >= 1"),
    (["--timed", "0"], 2, "--timed >= 1"),
    (["--workload", "W9"], 2, "invalid choice"),
    ([], 1, "needs a CUDA GPU"),
])
def test_bench_refuses_bad_flags_and_a_machine_without_cuda(args, rc, words):
    """`python -m poc.bench`: bad flags are argparse errors (exit 2) before anything runs; no CUDA is one line."""
    import torch

    if rc == 1 and torch.cuda.is_available():
        pytest.skip("CUDA is available: the benchmark would run")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-m", "poc.bench", *args], capture_output=True, text=True, timeout=120,
                       env=env, cwd=ROOT)
    assert r.returncode == rc and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_bench_records_the_command_with_the_settings_it_ran_under(monkeypatch):
    """Each result file's `command` reproduces the run: the POC_*/TORCHINDUCTOR_* settings, then the flags."""
    from poc.bench import command

    for k in [k for k in os.environ if k.startswith(("POC_", "TORCHINDUCTOR_"))]:
        monkeypatch.delenv(k)  # e.g. POC_TEST_DEVICE on a GPU run of the tests
    monkeypatch.setenv("POC_TP_REDUCE", "model")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/x")  # set by importing inductor: no setting of the run
    assert command(["--workload", "W7R", "--out", "a b.json"]) == \
        "POC_TP_REDUCE=model python -m poc.bench --workload W7R --out 'a b.json'"


def test_a_diagnostic_result_carries_its_command_settings_and_plot(monkeypatch, tmp_path):
    """write_result: the JSON a diagnostic leaves has the command that remakes it (its POC_* settings first), the
    date, the metadata and the result, and the plot is drawn from that same body beside it."""
    from poc.bench import write_result

    for k in [k for k in os.environ if k.startswith(("POC_", "TORCHINDUCTOR_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("POC_ROUTER_GEMM", "float32")
    drawn = []
    path = write_result(tmp_path / "h200" / "x.json", "benchmarks/diagnostics/x.py", ["--tokens", "8"],
                        {"rows": [1, 2]}, lambda body, png: drawn.append((body, png)), device="H200")
    body = json.loads(path.read_text())
    assert body["command"] == "POC_ROUTER_GEMM=float32 python benchmarks/diagnostics/x.py --tokens 8"
    assert body["device"] == "H200" and body["rows"] == [1, 2] and body["date"][:2] == "20"
    assert drawn == [(body, tmp_path / "h200" / "x.png")]

