"""`--model` as a Hugging Face repo id: resolved from the local Hugging Face cache, offline (nothing is downloaded
at run time), to the snapshot directory the loader reads.

    resolve_model("Qwen/Qwen3-0.6B")  ->  ~/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/<rev>

A directory that exists and `random:<preset>` are returned as given; a value shaped like `org/name` that is not a
directory is looked up in the cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) and is an
InputError naming that cache when it is not there.

The Gonka node's model routes (server/models.py) use the same cache, and only it: `check_repo_id` refuses anything
but a Hub repo id (no path, no URL), `cache_status` says whether a complete snapshot is there (DOWNLOADED), only part
of one (PARTIAL) or nothing (NOT_FOUND), `cached_models` lists the cache.
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


CACHE_NAME = "the local Hugging Face cache (HF_HUB_CACHE)"  # how texts a remote caller reads name it: no path


def hide_cache(text: str) -> str:
    """`text` with the hub cache's machine path (as set, and resolved) replaced by "$HF_HUB_CACHE": for what a
    remote caller reads (an error, /health's reason); the log keeps the full path."""
    cache = hub_cache_dir()
    for p in sorted({cache, os.path.realpath(cache)}, key=len, reverse=True):
        if p and len(p) > 1:
            text = text.replace(p.rstrip("/"), "$HF_HUB_CACHE")
    return text


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


# --------------------------------------------------------------------------------------------------
# the MLNode's model routes: a model id asked for by the node, looked up in the local cache only

HUB_NAME = re.compile(r"\w(?:[\w.-]*\w)?", re.ASCII)  # one part of a Hub repo id: starts and ends with a word char
MAX_REPO_ID = 96  # the Hub's limit
REVISION = re.compile(r"[\w.-]{1,96}", re.ASCII)  # a commit hash or a branch/tag name (no slash: nothing outside)


def check_repo_id(name, field: str = "model") -> str:
    """`name` if it is a Hugging Face Hub repo id ("name" or "org/name": letters, digits, "-", "_", "."; no "--" or
    ".."); else an InputError (400). Paths, "..", absolute and URL forms never pass: a model the node asks for is
    only ever looked up in the local cache."""
    if not isinstance(name, str) or not name:
        raise InputError(f"{field} must be a Hugging Face repo id (org/name), got {name!r:.80}", field)
    parts = name.split("/")
    if (len(name) > MAX_REPO_ID or len(parts) > 2 or not all(HUB_NAME.fullmatch(p) for p in parts)
            or "--" in name or ".." in name):
        raise InputError(f"{field} {name!r:.80} is not a Hugging Face repo id (org/name): a path, URL or other form "
                         "is never loaded", field)
    return name


def check_revision(rev, field: str = "hf_commit") -> str | None:
    if rev is None:
        return None
    if not isinstance(rev, str) or not REVISION.fullmatch(rev) or ".." in rev:
        raise InputError(f"{field} must be a commit hash or a branch name, got {rev!r:.80}", field)
    return rev


def cached_snapshot(repo_id: str, revision: str | None = None) -> str | None:
    """The snapshot directory of `repo_id` (at `revision`, else refs/main) in the local cache, or None; offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        return None


def snapshot_complete(path: str | Path) -> bool:
    """Whether a snapshot holds what the loader reads: config.json and every safetensors file (all the shards an
    index names), none of them a dangling link to a blob that never finished."""
    import json

    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return bool(shards) and all((p / s).is_file() for s in shards)
    return any(f.is_file() for f in p.glob("*.safetensors"))


def cache_status(repo_id: str, revision: str | None = None) -> tuple[str, str | None]:
    """(DOWNLOADED | PARTIAL | NOT_FOUND, the snapshot directory or None), as the MLNode's model manager says it
    (PARTIAL: the repo is in the cache but the snapshot misses files the loader needs)."""
    snap = cached_snapshot(repo_id, revision)
    if snap is not None:
        return ("DOWNLOADED" if snapshot_complete(snap) else "PARTIAL"), snap
    repo = Path(hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    return ("PARTIAL" if repo.is_dir() else "NOT_FOUND"), None


def cached_models() -> list[tuple[str, str, str]]:
    """(repo id, commit, DOWNLOADED | PARTIAL) of every model revision in the local cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache_dir())
    except (CacheNotFound, OSError):
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            out.append((repo.repo_id, rev.commit_hash,
                        "DOWNLOADED" if snapshot_complete(rev.snapshot_path) else "PARTIAL"))
    return out
