"""`--model` as a Hugging Face repo id: resolved from the local Hugging Face cache, offline (nothing is downloaded
at run time), to the snapshot directory the loader reads.

    resolve_model("Qwen/Qwen3-0.6B")  ->  ~/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/<rev>

A directory that exists and `random:<preset>` are returned as given; a value shaped like `org/name` that is not a
directory is looked up in the cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) and is an
InputError naming that cache when it is not there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from poc.errors import InputError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name, as the Hub spells them


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps downloads, read from the environment now (not at import time)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")


def resolve_model(name: str | None, flag: str = "--model") -> str | None:
    """A checkpoint directory for `name` (see the module docstring); no network access."""
    if not name or name.startswith("random:") or Path(name).exists() or not REPO_ID.fullmatch(name):
        return name  # a directory, a preset, or a path that does not exist (the loader says so)
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise InputError(f"{flag} {name} is not a directory, and huggingface_hub (requirements.txt) is not "
                         "installed to look it up as a Hugging Face repo id", "model") from None
    try:
        return snapshot_download(name, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise InputError(f"{flag} {name} is neither a directory nor a repo id in the local Hugging Face cache {cache} "
                         f"(nothing is downloaded at run time: `hf download {name}` first, or set HF_HUB_CACHE)",
                         "model") from None
