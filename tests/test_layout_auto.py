"""--layout auto (poc.engine.auto): the layout picked from the model's shape and the GPUs' memory, on fake GPUs."""

import logging

import pytest

from poc.engine.dist import DistEngine
from poc.engine.engine import Engine
from poc.engine.factory import make_engine
from poc.errors import InputError
from poc.model.config import PRESETS
from poc.model.options import ModelOptions
from poc.model.source import RandomPreset
from poc.engine import auto
from poc.engine.auto import GiB, Gpu
from poc.server.app import create_app
from poc.server.config import ServerConfig, parse_args
from poc.server.context import engine_key

H100 = Gpu("NVIDIA H100 80GB HBM3", int(79.19 * GiB))  # what torch reports as total_memory
H200 = Gpu("NVIDIA H200", int(139.8 * GiB))


def pick(model: str | None, gpus) -> tuple[int, int, int]:
    c = auto.for_model(model, "auto", gpus)
    return c.tp, c.pp, c.replicas


def test_the_choices_for_the_production_shapes():
    """Qwen3-235B-A22B-FP8 (W8A8, ~234 GB): pp=4 on four H100 (two cannot hold it), two replicas of pp=2 on four
    H200; on two H100 it fits no layout; a model one GPU holds is a replica a GPU."""
    assert pick("random:qwen3-235b-a22b:fp8", [H100] * 4) == (1, 4, 1)
    assert pick("random:qwen3-235b-a22b:fp8", [H200] * 4) == (1, 2, 2)
    assert pick("random:qwen3-235b-a22b:fp8", [H100] * 8) == (1, 4, 2)
    with pytest.raises(InputError, match="does not fit 2 x NVIDIA H100.*not pp=2 \\(108.9 GiB of weights a GPU\\)"):
        pick("random:qwen3-235b-a22b:fp8", [H100] * 2)
    assert pick("random:qwen3-30b-a3b:fp8", [H100] * 2) == (1, 1, 2)
    assert pick("random:qwen3-8b", [H100] * 4) == (1, 1, 4)
    assert pick(None, [H100] * 4) == (1, 1, 4)  # PoC v1 only: a request's model fits one GPU
    assert pick("random:qwen3-8b", []) == (1, 1, 1)  # no GPU: one process
    c = auto.for_model("random:qwen3-235b-a22b:fp8", "auto", [H100] * 4)
    assert c.label() == "pp=4" and "55.6 GiB of weights" in c.why and "not 2 replicas of tp=2" in c.why


def test_weights_a_gpu_holds():
    cfg = PRESETS["qwen3-235b-a22b"]
    whole = auto.rank_weight_bytes(cfg, 1, 1, 2, "w8a8")
    assert 233e9 < whole < 236e9  # 235B parameters, nearly all in FP8 linears
    assert auto.rank_weight_bytes(cfg, 1, 1, 2, None) > 1.99 * whole  # bf16
    for tp, pp in ((4, 1), (1, 4), (2, 2)):
        share = auto.rank_weight_bytes(cfg, tp, pp, 2, "w8a8")
        assert whole / 4 < share < 1.03 * whole / 4, (tp, pp)  # a quarter, plus norms, router, an uneven stage


def test_preference_order_and_splits_the_model_cannot_take():
    """The smallest group first (more replicas); within a group pp before tp; a split the model refuses is skipped
    with its reason: tiny (2 layers, 2 kv heads) on four GPUs that only a group of four fits takes pp=2 x tp=2."""
    assert list(auto.candidates(4)) == [(1, 1, 4), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 1), (4, 1, 1)]
    cfg = PRESETS["tiny"]
    need = auto.rank_weight_bytes(cfg, 2, 2, 4, None)
    act = auto.memory.v2_estimate(cfg, auto.FIT_BATCH, auto.FIT_SEQ, 4, tp=2, cuda=True, fused=True).device_total
    small = Gpu("small", int((need + act) / 0.9 + auto.RESERVE) + 1)
    c = auto.choose(cfg, [small] * 4, 4)
    assert (c.tp, c.pp, c.replicas) == (2, 2, 1), c.why
    assert "not pp=4 (n_layers=2 is fewer than pp=4 stages)" in c.why


def test_server_flag(caplog):
    assert parse_args(["--layout", "auto"], env={}).layout == "auto"
    assert parse_args([], env={"POC_LAYOUT": "auto"}).layout == "auto"
    with pytest.raises(InputError, match="--layout must be auto"):
        parse_args(["--layout", "fastest"], env={})
    with pytest.raises(InputError, match="leave out --tp 2"):
        parse_args(["--layout", "auto", "--tp", "2"], env={})
    with caplog.at_level(logging.INFO, logger="poc.engine"):
        app = create_app(ServerConfig(device="cpu", model="random:tiny", layout="auto"))
    assert isinstance(app[engine_key], Engine)  # the CPU: one process
    assert "--layout auto: no GPU visible: one process" in caplog.messages, caplog.messages


def test_the_factory_builds_the_chosen_layout(monkeypatch, caplog):
    """make_engine(layout="auto") (the server's, the CLI's and the bench's one factory) runs what auto.for_model
    chose: here pp=2 x 2 replicas on the CPU, a DistEngine over 4 ranks (never started); a layout other than auto
    is refused."""
    seen = []

    def for_model(model, dtype, gpus, options):
        seen.append((model, dtype, gpus, options))
        return auto.Choice(1, 2, 2, "planted")

    monkeypatch.setattr(auto, "for_model", for_model)
    opts = ModelOptions(fp8="dequant", fp8_experts="dequant")
    with caplog.at_level(logging.INFO, logger="poc.engine"):
        e = make_engine("cpu", "random:tiny", "float32", layout="auto", options=opts)
    try:
        assert isinstance(e, DistEngine) and (e.layout.world, e.layout.tp, e.layout.pp) == (4, 1, 2)
        assert e.options == opts  # the ranks get them (RankConfig)
    finally:
        e.close()
    assert seen == [(RandomPreset("tiny"), "float32", [], opts)]  # parsed once; the CPU: no GPU looked for
    assert "--layout auto: planted" in caplog.messages
    with pytest.raises(InputError, match="layout must be auto"):
        make_engine("cpu", layout="fastest")
