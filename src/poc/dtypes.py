"""The float dtypes a model runs in, by name: the one table (torch-free, so flags parse before torch loads)."""

BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}  # name -> bytes per element
NAMES = tuple(BYTES)  # as flags and request fields spell them
