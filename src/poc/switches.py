"""Reading one POC_* switch's value from a mapping of environment variables (the entry points pass os.environ).

Plain Python, the lowest layer: the settings that read switches (model/options.py's ModelOptions, the engine's rank
diagnostics, the server's ServerConfig) share these rules, so an on/off switch means the same everywhere.
"""

from __future__ import annotations

from typing import Mapping

from poc.errors import InputError


def env_flag(env: Mapping[str, str], name: str, default: bool, field: str) -> bool:
    """An on/off switch: 1/true or 0/false (any case; unset or empty: `default`); else an InputError naming it."""
    v = env.get(name, "").strip().lower()
    if v not in ("", "0", "1", "false", "true"):
        raise InputError(f"{name} must be 0 or 1, got {v!r}", field)
    return default if v == "" else v in ("1", "true")
