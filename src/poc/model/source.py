"""Where a model's weights come from, parsed once: a typed model source.

- `Checkpoint(path)`: a Hugging Face checkpoint directory (config.json and safetensors: weights.py);
- `RandomPreset(preset, fp8)`: `random:<preset>[:fp8]`, random weights of a preset's real shape (config.PRESETS,
  random_weights.py), for benchmarks and demos without a download; `:fp8` an FP8 checkpoint's model;
- `V1Weights(params, block_hash)`: PoC v1's random model, its weights drawn from the block hash (random_init.py).

`parse()` turns a --model string (the server's flag, a checkpoint /api/v1/inference/up loads, the bench's preset)
into one of the first two, once, where it enters; the engine factory, --layout auto, the engines' preflight and the
builder (parallel/build.py) take the parsed source, and a rank process gets it in its load command. Each source says
its config without loading a weight (`config()`) and how it is named. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Union

from poc.errors import InputError
from poc.model.config import PRESETS, ModelConfig
from poc.protocol import v1

RANDOM_PREFIX = "random:"  # a model "directory" of the form random:<preset>[:fp8] (benchmarks, demos)
FP8_BLOCK = (128, 128)  # a random FP8 model's weight blocks, as the Qwen and MiniMax FP8 checkpoints' config says


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face checkpoint directory, as given (a path, absolute or not)."""

    path: str

    def config(self) -> ModelConfig:
        """Its config.json (InputError when it is missing or cannot be served)."""
        return ModelConfig.from_hf(self.path)

    @property
    def name(self) -> str:
        return Path(self.path).name

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True)
class RandomPreset:
    """random:<preset>[:fp8]: random weights of a preset's shape; `fp8`: an FP8 checkpoint's model (its weights
    float8_e4m3fn with 128x128 block scales, computed as ModelOptions.fp8 says)."""

    preset: str
    fp8: bool = False

    def config(self) -> ModelConfig:
        cfg = PRESETS[self.preset]
        return replace(cfg, fp8_block=FP8_BLOCK) if self.fp8 else cfg  # an FP8 checkpoint's quantization_config

    @property
    def name(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return f"{RANDOM_PREFIX}{self.preset}" + (":fp8" if self.fp8 else "")


@dataclass(frozen=True)
class V1Weights:
    """PoC v1's random model: its weights drawn from the block hash for these params."""

    params: v1.V1Params
    block_hash: str

    def config(self) -> ModelConfig:
        from poc.model.random_init import v1_config

        return v1_config(self.params)


ModelSource = Union[Checkpoint, RandomPreset, V1Weights]


def parse(model: str | Path | ModelSource) -> ModelSource:
    """The source a --model names: "random:<preset>[:fp8]" (a preset of config.PRESETS; anything else after
    "random:" is an InputError naming the presets) or a checkpoint directory; a source already parsed as it is."""
    if isinstance(model, (Checkpoint, RandomPreset, V1Weights)):
        return model
    text = str(model)
    if not text.startswith(RANDOM_PREFIX):
        return Checkpoint(text)
    name, _, opt = text[len(RANDOM_PREFIX):].partition(":")
    if name not in PRESETS or opt not in ("", "fp8"):
        raise InputError(f"--model {text!r}: expected random:<preset>[:fp8] with a preset of "
                         f"{', '.join(sorted(PRESETS))}", "model")
    return RandomPreset(name, opt == "fp8")
