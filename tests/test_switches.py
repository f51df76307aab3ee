"""The POC_* environment switches, read from the source: each is read once, where the settings are parsed (the
server's ServerConfig, the command-line tools' argument parsing), and passed down as arguments (ModelOptions, the
ranks' RankConfig); no other module reads the environment for one. And README.md's Configuration table lists every
switch the code reads."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from poc import cli
from poc.errors import InputError
from poc.model.options import ModelOptions
from poc.engine.rankgroup import RankDiagnostics
from poc.server.config import parse_args

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
NAME = re.compile(r"POC_[A-Z0-9_]+")
# where switches are read: the server's settings and the command-line tools' argument parsing
READERS = {"poc.server.config", "poc.cli", "poc.bench", "poc.clients.spool",
           "poc.model.options", "poc.engine.rankgroup"}  # ModelOptions.from_env, RankDiagnostics.from_env (a mapping)
# not switches: the secret the engine hands its rank processes (a child's environment, read once and removed)
INTERNAL = {"POC_RANK_KEY"}


def _is_environ(node: ast.AST) -> bool:
    """os.environ, or environ imported from os."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _is_getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv") or \
        (isinstance(node, ast.Name) and node.id == "getenv")


def _key(node: ast.AST | None) -> str:
    """The variable a read names: the constant, or "?" for a key computed at run time."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"


def env_reads(source: str) -> list[tuple[str, int]]:
    """(variable, line) of every keyed read of the process environment in `source`: os.environ[...],
    os.environ.get/pop/setdefault(...), os.getenv(...), `... in os.environ`. A key computed at run time is "?"."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            out.append((_key(node.slice), node.lineno))
        elif isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) \
                    or _is_getenv(f):
                out.append((_key(node.args[0] if node.args else None), node.lineno))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            out.append((_key(node.left), node.lineno))
    return out


def violations(module: str, source: str) -> list[str]:
    """A module outside READERS that reads a POC_* variable (or a variable it names only at run time) from the
    environment."""
    if module in READERS:
        return []
    return [f"{module}:{line} reads {name} from the environment" for name, line in env_reads(source)
            if name == "?" or (name.startswith("POC_") and name not in INTERNAL)]


def switch_names(module: str, source: str) -> set[str]:
    """The POC_* switches a module reads: its keyed environment reads, and in READERS every "POC_..." string
    constant (ServerConfig reads through its ENV table and an `env` mapping)."""
    names = {name for name, _ in env_reads(source) if NAME.fullmatch(name)}
    if module in READERS:
        names |= {n.value for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.fullmatch(n.value)}
    return names - INTERNAL


def readme_switches(readme: str) -> set[str]:
    """The variables named in the environment column of README's Configuration table."""
    section = readme.split("\n## Configuration", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 3:
            names |= set(NAME.findall(cells[2]))
    return names


def modules() -> dict[str, str]:
    out = {}
    for path in sorted((SRC / "poc").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def test_no_module_below_the_settings_reads_a_switch():
    mods = modules()
    # the engine room is scanned too: the engines, the rank process, the factory, --layout auto and the builder
    assert {"poc.engine.dist", "poc.engine.ranks", "poc.engine.factory", "poc.engine.auto", "poc.parallel.build",
            "poc.parallel.tp", "poc.model.transformer", "poc.protocol.pool"} <= set(mods)
    found = [v for module, source in mods.items() for v in violations(module, source)]
    assert not found, "read it in ServerConfig (or the tool's argument parsing) and pass it down:\n" + "\n".join(found)


def test_the_readme_table_lists_every_switch():
    names = set().union(*(switch_names(m, s) for m, s in modules().items()))
    assert {"POC_FP8", "POC_TP_REDUCE", "POC_POOL_WORKERS", "POC_HOST", "POC_COMPILE_INPUTS"} <= names  # it sees them
    missing = names - readme_switches((ROOT / "README.md").read_text())
    assert not missing, f"README.md's Configuration table lacks {sorted(missing)}"


def test_the_checks_catch_a_planted_violation():
    deep = '''
import os
from os import environ, getenv
FUSED = os.environ.get("POC_FOO", "1") == "1"
def f(name):
    return environ["POC_BAR"], getenv("POC_BAZ"), "POC_QUX" in os.environ, os.environ.get(name)
def g():
    return os.environ["HF_HOME"], os.environ.pop("POC_RANK_KEY")
'''
    got = violations("poc.model.fp8", deep)
    assert [v.split(" reads ")[1] for v in got] == [f"{n} from the environment" for n in
                                                    ("POC_FOO", "POC_BAR", "POC_BAZ", "POC_QUX", "?")], got
    assert violations("poc.server.config", deep) == []  # where switches belong
    assert switch_names("poc.model.fp8", deep) == {"POC_FOO", "POC_BAR", "POC_BAZ", "POC_QUX"}
    readme = ("# x\n## Configuration\n\n| flag | environment | default |\n|---|---|---|\n"
              "| `--a` | `POC_FOO` | see `POC_BAR` |\n| (env only) | `POC_BAZ`, `POC_QUX` | 1 |\n\n## Next\n| | `POC_BAR` |")
    assert readme_switches(readme) == {"POC_FOO", "POC_BAZ", "POC_QUX"}  # POC_BAR only in other columns or sections


def test_the_settings_read_the_model_and_rank_switches(monkeypatch):
    """ServerConfig reads them (defaults as before: W8A8, UE8M0, experts kept, fused norm and Gluon on, fp32 reduce,
    the CPU count) and a bad value stops the start naming the variable; python -m poc reads the same ones."""
    d = parse_args([], env={})
    assert d.options == ModelOptions() == ModelOptions("w8a8", "ue8m0", "keep", True, True, "fp32", None)
    assert d.diagnostics == RankDiagnostics(stage_timing=False, profile_dir=None)
    c = parse_args([], env={"POC_FP8": "dequant", "POC_FP8_FUSED_NORM": "0", "POC_FP8_GLUON": "0",
                            "POC_TP_REDUCE": "model", "POC_POOL_WORKERS": "3", "POC_STAGE_TIMING": "1",
                            "POC_RANK_PROFILE": "/tmp/prof", "POC_FP8_EXPERTS": "dequant"})
    assert c.options == ModelOptions(fp8="dequant", fp8_experts="dequant", fused_norm=False, gluon=False,
                                     tp_reduce="model", pool_workers=3)
    assert c.diagnostics == RankDiagnostics(stage_timing=True, profile_dir="/tmp/prof")
    assert ModelOptions.from_env({"POC_FP8_SCALES": "float32"}) == ModelOptions(fp8_scales="float32")
    assert ModelOptions.from_env({"POC_FP8_SCALES": "float32"}, fp8_scales="ue8m0") == ModelOptions()  # a flag wins
    for var, bad, message in [("POC_FP8", "int4", "POC_FP8 must be w8a8 or dequant"),
                              ("POC_FP8_FUSED_NORM", "on", "POC_FP8_FUSED_NORM must be 0 or 1"),
                              ("POC_FP8_GLUON", "2", "POC_FP8_GLUON must be 0 or 1"),
                              ("POC_TP_REDUCE", "bf16", "POC_TP_REDUCE must be fp32 or model"),
                              ("POC_POOL_WORKERS", "0", "POC_POOL_WORKERS must be an integer >= 1"),
                              ("POC_POOL_WORKERS", "many", "POC_POOL_WORKERS must be an integer >= 1"),
                              ("POC_STAGE_TIMING", "yes", "POC_STAGE_TIMING must be 0 or 1")]:
        with pytest.raises(InputError, match=message):
            parse_args([], env={var: bad})
    monkeypatch.setenv("POC_FP8_GLUON", "2")  # the CLI: refused before any model is built
    with pytest.raises(InputError, match="POC_FP8_GLUON must be 0 or 1"):
        cli.run(["v1", "--params", "{}", "--block-hash", "h", "--public-key", "k", "--nonces", "0-1"])
