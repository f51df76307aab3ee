"""The package's layering, read from the source: no import cycle between modules, and no import from a lower layer
into a higher one. Every import counts, also one inside a function or under TYPE_CHECKING: a deferred import is
still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# lowest first: a module may import its own layer and the layers before it
LAYERS = [
    ("poc", "poc.dtypes", "poc.errors", "poc.logs", "poc.profiling"),
    ("poc.protocol",),
    ("poc.model",),
    ("poc.parallel",),
    ("poc.engine",),
    ("poc.clients",),
    ("poc.server",),
    ("poc.cli", "poc.bench", "poc.serve", "poc.__main__"),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "poc").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The poc modules `name` imports (a `from pkg import mod` names the module when it is one)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "poc")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            if base.split(".")[0] != "poc":
                continue
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


def test_every_module_has_a_layer_and_imports_resolve():
    g = graph()
    for name, deps in g.items():
        layer(name)
        unknown = {d for d in deps if d not in g}
        assert not unknown, f"{name} imports modules that do not exist: {sorted(unknown)}"


def test_no_upward_import():
    up = sorted(f"{name} ({LAYERS[layer(name)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
                for name, deps in graph().items() for d in deps if layer(d) > layer(name))
    assert not up, "imports from a lower layer into a higher one:\n" + "\n".join(up)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer("poc.model.transformer") < layer("poc.engine.compute") < layer("poc.server.app")
    assert layer("poc.logs") < layer("poc.protocol.v1")


ENGINE_ROOM = "poc.engine"


def engines_outside(sources: dict[str, str]) -> list[str]:
    """Engines defined outside poc.engine, in `sources` (module name -> source): a class deriving from EngineBase
    (directly or through another engine class, by base name), or a rank process (a module that joins a process
    group: init_process_group)."""
    classes = {}  # (module, class) -> the last dotted part of each base
    joins = set()
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                classes[(name, node.name)] = {ast.unparse(b).split(".")[-1] for b in node.bases}
            elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "init_process_group":
                joins.add(name)
    engines = {"EngineBase"}
    while True:
        more = {cls for (_, cls), bases in classes.items() if bases & engines} - engines
        if not more:
            break
        engines |= more
    found = [f"{m}.{cls} is an engine (EngineBase)" for (m, cls) in sorted(classes)
             if cls in engines and cls != "EngineBase"]
    found += [f"{m} joins a process group (a rank process)" for m in sorted(joins)]
    return [f for f in found if not (f.startswith(ENGINE_ROOM + ".") or f.startswith(ENGINE_ROOM + " "))]


def test_every_engine_lives_in_the_engine_room():
    """The one-device engine, the distributed one and its rank processes are all in poc.engine; poc.parallel only
    rewrites a built model, and nothing above poc.engine runs one of its own."""
    bad = engines_outside({name: path.read_text() for name, path in modules().items()})
    assert not bad, "engines outside poc.engine:\n" + "\n".join(bad)


def test_the_engine_room_check_sees_each_kind():
    """An engine class outside poc.engine (here one deriving from an engine through a module attribute) and a rank
    process outside it are named; the ones inside are not, nor a class that is no engine."""
    found = engines_outside({
        "poc.engine.base": "class EngineBase(abc.ABC):\n    pass\n",
        "poc.engine.engine": "class Engine(EngineBase):\n    pass\n",
        "poc.engine.ranks": "import torch.distributed as dist\ndist.init_process_group('gloo')\n",
        "poc.parallel.engine": "from poc.engine import engine\nclass DistEngine(engine.Engine):\n    pass\n",
        "poc.parallel.ranks": "def main():\n    torch.distributed.init_process_group('nccl')\n",
        "poc.server.jobs": "class Runner:\n    pass\n"})
    assert found == ["poc.parallel.engine.DistEngine is an engine (EngineBase)",
                     "poc.parallel.ranks joins a process group (a rank process)"]


def engine_misuse(source: str) -> list[str]:
    """In server code: an engine's private attribute read, a getattr() on an engine, or a write to an engine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and "engine" in ast.unparse(node.value):
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"line {node.lineno}: reads {ast.unparse(node)}")
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                found.append(f"line {node.lineno}: writes {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr", "setattr") and \
                node.args and "engine" in ast.unparse(node.args[0]):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_server_uses_only_the_engine_interface():
    """The server reads the engine through EngineBase's public names and changes it only through its methods."""
    bad = [f"{p.name} {m}" for p in sorted((SRC / "poc" / "server").glob("*.py")) for m in engine_misuse(p.read_text())]
    assert not bad, "the server reaches into the engine:\n" + "\n".join(bad)


def test_the_engine_misuse_check_sees_each_kind():
    src = ("x = app[engine_key]._v1\nfree = getattr(engine, 'free_bytes', None)\nself.engine.state = 'broken'\n"
           "ok = engine.state\nengine.mark_broken('r')\n")
    assert [m.split(":")[0] for m in engine_misuse(src)] == ["line 1", "line 2", "line 3"]


# --- outside the package: tests import helpers, never a test module; diagnostics and scripts use public names ------

ROOT = SRC.parent
TEST_ROOTS = [ROOT / "tests", ROOT / "benchmarks", ROOT / "scripts"]  # who may not import a test module
USER_ROOTS = [ROOT / "benchmarks", ROOT / "scripts"]  # who use the package from outside: public names only


def python_files(roots: list[Path]) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def imports_of_test_modules(source: str) -> list[str]:
    """The imports of one of our test modules in `source` (relative, or under `tests`, with a dotted part named
    test_*; aiohttp.test_utils is not ours), every import counted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [f"{base}.{a.name}" if base.rstrip(".") else base + a.name for a in node.names]
        else:
            continue
        for n in names:
            parts = n.lstrip(".").split(".")
            ours = n.startswith(".") or parts[0] == "tests" or parts[0].startswith("test_")
            if ours and any(p.startswith("test_") for p in parts):
                found.append(f"line {node.lineno}: {n}")
    return found


def private_names(source: str) -> list[str]:
    """Private names of poc that `source` uses: `from poc.x import _y`, or `_y` read off a poc module it imported."""
    found, mods = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "poc":
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"line {node.lineno}: imports {node.module}.{a.name}")
                mods.add(a.asname or a.name)  # a module or not: an attribute `_x` read off it is private either way
        elif isinstance(node, ast.Import):
            mods.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "poc")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and ast.unparse(node.value).split(".")[0] in mods):
            found.append(f"line {node.lineno}: reads {ast.unparse(node)}")
    return found


def test_no_test_module_imports_another():
    """Tests share code through helper modules (tests/servers.py, tests/checkpoints.py, ...), and so do the
    benchmarks and scripts: importing a test module runs its collection-time code and ties two suites together."""
    bad = [f"{p.relative_to(ROOT)} {m}" for p in python_files(TEST_ROOTS)
           for m in imports_of_test_modules(p.read_text())]
    assert not bad, "imports of a test module (move what is shared into a helper module):\n" + "\n".join(bad)


def test_diagnostics_and_scripts_use_public_names():
    bad = [f"{p.relative_to(ROOT)} {m}" for p in python_files(USER_ROOTS) for m in private_names(p.read_text())]
    assert not bad, "private names of poc used from outside the package:\n" + "\n".join(bad)


def patches_sys_path(source: str) -> list[str]:
    """Where `source` changes sys.path: sys.path.insert/append/extend, or an assignment to it or a slice of it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append",
                                                                      "sys.path.extend"):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if ast.unparse(t).startswith("sys.path"):
                    found.append(f"line {node.lineno}: {ast.unparse(t)} = ...")
    return found


def test_diagnostics_and_scripts_leave_sys_path_alone():
    """They run with the package on the path (the venv's .pth from scripts/ensure_venv.sh, or benchmarks/run.sh's
    PYTHONPATH, `PYTHONPATH=src:.` by hand for the few that read tests/ helpers), as an installed user would: a path
    patched in one script hides which checkout it runs."""
    bad = [f"{p.relative_to(ROOT)} {m}" for p in python_files(USER_ROOTS) for m in patches_sys_path(p.read_text())]
    assert not bad, "sys.path changed by a diagnostic or script:\n" + "\n".join(bad)


def test_each_rule_fails_on_a_planted_violation(tmp_path, monkeypatch):
    """Every check above, run on a small tree with one violation of its rule planted, fails and names it."""
    def write(rel: str, text: str = "") -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    for pkg in ("poc", "poc/protocol", "poc/model", "poc/server"):
        write(f"src/{pkg}/__init__.py")
    write("src/poc/protocol/v1.py", "def target():\n    from poc.server import app  # deferred: still counts\n")
    write("src/poc/server/app.py", "from poc.engine.engine import Engine\n\nclass Patched(Engine):\n    pass\n")
    write("src/poc/engine/__init__.py")
    write("src/poc/engine/base.py", "class EngineBase:\n    pass\n")
    write("src/poc/engine/engine.py", "from poc.engine.base import EngineBase\n\nclass Engine(EngineBase):\n    pass\n")
    write("src/poc/engine/ranks.py", "import torch.distributed as dist\ndist.init_process_group('gloo')\n")  # fine
    write("src/poc/model/ranks.py", "from torch import distributed\ndistributed.init_process_group('gloo')\n")
    write("src/poc/model/a.py", "from poc.model import b\n")
    write("src/poc/model/b.py", "from poc.model.a import f\n")
    write("tests/checkpoints.py", "from tests import test_moe\n")  # a helper importing a test module
    write("tests/test_moe.py", "from aiohttp.test_utils import TestServer\nfrom .checkpoints import make\n")  # fine
    write("tests/test_fp8.py", "def test_x():\n    from .test_moe import CASES\n")
    write("benchmarks/diagnostics/w8a8.py",
          "from poc.model import fp8\nfrom poc.model.transformer import _act\nglu = fp8._gluon(None)\n")
    write("benchmarks/diagnostics/old.py", "import sys\nsys.path.insert(0, 'src')\nsys.path[:0] = ['.']\n")
    module = globals()
    monkeypatch.setitem(module, "SRC", tmp_path / "src")
    monkeypatch.setitem(module, "ROOT", tmp_path)
    monkeypatch.setitem(module, "TEST_ROOTS", [tmp_path / "tests", tmp_path / "benchmarks"])
    monkeypatch.setitem(module, "USER_ROOTS", [tmp_path / "benchmarks"])
    checks = [
        (test_no_upward_import, ["poc.protocol.v1 (poc.protocol) imports poc.server.app (poc.server)"]),
        (test_no_import_cycle, ["poc.model.a <-> poc.model.b"]),
        (test_every_engine_lives_in_the_engine_room, ["poc.server.app.Patched is an engine",
                                                      "poc.model.ranks joins a process group"]),
        (test_no_test_module_imports_another, ["tests/checkpoints.py line 1: tests.test_moe",
                                               "tests/test_fp8.py line 2: .test_moe.CASES"]),
        (test_diagnostics_and_scripts_use_public_names, ["line 2: imports poc.model.transformer._act",
                                                          "line 3: reads fp8._gluon"]),
        (test_diagnostics_and_scripts_leave_sys_path_alone, ["old.py line 2: sys.path.insert",
                                                             "old.py line 3: sys.path[:0] = ..."]),
    ]
    for check, named in checks:
        with pytest.raises(AssertionError) as e:
            check()
        assert all(n in str(e.value) for n in named), (check.__name__, str(e.value))
        assert "test_moe.py" not in str(e.value)  # a test module importing a helper is fine
    test_every_module_has_a_layer_and_imports_resolve()  # nothing missing yet
    write("src/poc/model/c.py", "import poc.model.missing\n")
    with pytest.raises(AssertionError, match=r"poc.model.c imports modules that do not exist: \['poc.model.missing"):
        test_every_module_has_a_layer_and_imports_resolve()


# --- the server's route modules: side by side, composed by app.py alone ------------------------------------------

COMPOSER = "poc.server.app"  # create_app: registers every route module
ROUTE_CALLS = {"RouteTableDef", "add_routes", "add_subapp", "add_route", "add_get", "add_post", "add_put", "add_patch",
               "add_delete", "add_head", "add_view", "add_static"}


def registers_routes(source: str) -> bool:
    """A module registers aiohttp routes: it makes a RouteTableDef or calls add_routes/add_subapp/router.add_*."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ROUTE_CALLS:
                return True
    return False


def route_modules() -> set[str]:
    """The modules of poc.server that register routes, app.py (which composes them) aside."""
    return {name for name, path in modules().items()
            if name.startswith("poc.server.") and name != COMPOSER and registers_routes(path.read_text())}


def test_the_route_modules_are_the_apis():
    """The detection finds every API's module (a new one is found by the same rule) and nothing that only helps."""
    found = route_modules()
    assert {f"poc.server.{m}" for m in ("vast", "pow", "mlnode", "models", "gpu", "pooled", "warmup")} <= found, found
    assert not found & {"poc.server.jobs", "poc.server.pow_service", "poc.server.context", "poc.server.stream"}, found


def test_no_route_module_imports_another():
    """Route modules stand side by side: what two of them share lives in a module that registers no route
    (server/jobs.py, server/pow_service.py, ...), and only app.py imports a route module, so no shared module is a
    back door from one route module to another."""
    routes, g = route_modules(), graph()
    bad = sorted(f"route module {name} imports route module {d}" if name in routes else
                 f"{name} imports route module {d} (only {COMPOSER} composes them)"
                 for name, deps in g.items() if name != COMPOSER for d in deps if d in routes)
    assert not bad, "imports of a route module:\n" + "\n".join(bad)


def test_the_route_rule_fails_on_a_planted_violation(tmp_path, monkeypatch):
    """A route module importing another, and a shared module importing a route module, are both named; app.py
    importing them and a route module importing a shared module are not."""
    files = {
        "__init__.py": "", "server/__init__.py": "",
        "server/app.py": "from poc.server import a, b\n\ndef create_app(app):\n    a.setup(app)\n    b.setup(app)\n",
        "server/a.py": "from aiohttp import web\nfrom poc.server.shared import helper\nroutes = web.RouteTableDef()\n",
        "server/b.py": "def setup(app):\n    from poc.server.a import routes  # deferred: still counts\n"
                       "    app.router.add_get('/b', routes)\n",
        "server/shared.py": "def helper():\n    from poc.server import b\n",
    }
    for rel, text in files.items():
        (tmp_path / "poc" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "poc" / rel).write_text(text)
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    assert route_modules() == {"poc.server.a", "poc.server.b"}
    with pytest.raises(AssertionError) as e:
        test_no_route_module_imports_another()
    assert "route module poc.server.b imports route module poc.server.a" in str(e.value)
    assert "poc.server.shared imports route module poc.server.b (only poc.server.app composes them)" in str(e.value)
    assert "poc.server.app imports" not in str(e.value) and "poc.server.a imports" not in str(e.value)


# --- the model's settings: one typed door (model/options.py), read by the model when it is built -----------------

MODEL_ROOM = "poc.model"  # the model and its loaders: they configure a model from its ModelOptions
REWRITE_ROOM = "poc.parallel"  # rewrites of a built model (tp slices, pipeline cuts): structure, never a setting


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def model_attributes(sources: dict[str, str]) -> tuple[set[str], set[str]]:
    """(the attributes the model room's nn.Module classes set on themselves, and `forward`; the settings among them:
    those a class sets from its ModelOptions (`self.x = options.y...`), and `options`), read from `sources`."""
    classes = {}
    for name, source in sources.items():
        if in_room(name, MODEL_ROOM):
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = ({ast.unparse(b).split(".")[-1] for b in node.bases}, node)
    mods = {"Module"}
    while more := {c for c, (bases, _) in classes.items() if bases & mods} - mods:
        mods |= more
    attrs, settings = {"forward"}, {"options"}
    for cls in mods - {"Module"}:
        for node in ast.walk(classes[cls][1]):
            if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or node.value is None:
                continue
            reads = any(isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "options"
                        for x in ast.walk(node.value))
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for x in ast.walk(target):
                    if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                        attrs.add(x.attr)
                        settings |= {x.attr} if reads else set()
    return attrs, settings


def sets_attributes(source: str, names: set[str]) -> list[str]:
    """Where `source` sets or deletes one of `names` on an object other than its own (`self`): `x.name = ...`,
    `del x.name`, `x.name += ...`, `setattr(x, "name", ...)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.attr in names
                and ast.unparse(node.value) != "self"):
            found.append(f"line {node.lineno}: sets {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_model_sets_its_modules_attributes():
    """No module outside model/ sets an attribute on a model module: the model configures itself from its
    ModelOptions when it is built (no engine code setting a block's or a MoE's flags). parallel/ rewrites a built
    model's structure (slices, local head counts, the all-reduces after o_proj/down_proj/a MoE block with their
    reduce dtype), and even it sets none of the settings the model reads from its options. The diagnostics and
    scripts set none either."""
    sources = {name: path.read_text() for name, path in modules().items()}
    attrs, settings = model_attributes(sources)
    assert {"fused_norm", "gluon", "fast", "recipe", "attention", "options"} <= settings  # it sees them
    assert {"n_heads", "sum_dtype", "w13", "ue8m0", "forward"} <= attrs - settings
    bad = [f"{name} {m}" for name, source in sources.items() if not in_room(name, MODEL_ROOM)
           for m in sets_attributes(source, settings if in_room(name, REWRITE_ROOM) else attrs)]
    bad += [f"{p.relative_to(ROOT)} {m}" for p in python_files(USER_ROOTS)
            for m in sets_attributes(p.read_text(), attrs)]
    assert not bad, ("set on a model module from outside model/ (give the model a ModelOptions field and let it "
                     "read it when it is built):\n" + "\n".join(bad))


def option_values() -> dict[str, tuple[str, ...]]:
    """Each Literal-typed ModelOptions field's allowed values, from its type (written once, in model/options.py)."""
    import dataclasses
    import typing

    from poc.model.options import ModelOptions, values

    hints = typing.get_type_hints(ModelOptions)
    return {f.name: values(hints[f.name]) for f in dataclasses.fields(ModelOptions) if values(hints[f.name])}


def values_written_again(source: str, options: dict[str, tuple[str, ...]]) -> list[str]:
    """Collections of string constants in `source` (a tuple, list or set, a dict's keys) that spell out an option's
    allowed values again: all of them, or all but one of three or more (the recipes without `auto`). The arguments of
    a Literal[...] type are where they are written, and a pair of one option's many values is logic, not a copy."""
    tree = ast.parse(source)
    literal = {id(n.slice) for n in ast.walk(tree)
               if isinstance(n, ast.Subscript) and ast.unparse(n.value).split(".")[-1] == "Literal"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in literal:
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = node.keys
        else:
            continue
        words = {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        for name, allowed in options.items():
            if len(words) >= max(2, len(allowed) - 1) and words <= set(allowed):
                found.append(f"line {node.lineno}: {ast.unparse(node)[:70]} (ModelOptions.{name}'s values)")
    return found


def test_the_allowed_values_of_each_option_are_written_once():
    """Each option's allowed values are its Literal type in model/options.py, checked there once when the options
    are made; nothing else in the package, the diagnostics or the scripts spells them out again (a copy drifts:
    import the type's tuple, e.g. options.FP8_SCALES, or let ModelOptions check)."""
    options = option_values()
    assert options["fp8_scales"] == ("ue8m0", "float32") and "auto" in options["attention"]  # it sees them
    files = [(name, path) for name, path in modules().items()] + [(str(p.relative_to(ROOT)), p)
                                                                  for p in python_files(USER_ROOTS)]
    bad = [f"{name} {m}" for name, path in files for m in values_written_again(path.read_text(), options)]
    assert not bad, "an option's allowed values written again:\n" + "\n".join(bad)


def test_the_settings_rules_fail_on_planted_violations(tmp_path, monkeypatch):
    """An engine setting a MoE's flag, a rewrite setting a block's setting, a diagnostic setting one through
    setattr, and a module checking an option's values against its own copy are each named; the model room setting
    its own, a rewrite slicing the structure, and a Literal type are not."""
    files = {
        "src/poc/model/transformer.py": (
            "class Block(nn.Module):\n    def __init__(self, cfg, options):\n"
            "        self.fused_norm = options.fused_norm\n        self.n_heads = cfg.n_heads\n"
            "class MoE(nn.Module):\n    def __init__(self, cfg, options):\n        self.fast = options.compiled\n"),
        "src/poc/model/fp8.py": "def use_scales(model):\n    for m in model.modules():\n        m.fast = True\n",
        "src/poc/model/options.py": "Fp8Scales = Literal['ue8m0', 'float32']\n",
        "src/poc/parallel/tp.py": "def apply_tp(block):\n    block.n_heads //= 2\n    block.fused_norm = False\n",
        "src/poc/engine/compute.py": ("def setup(model):\n    for b in model.layers.values():\n"
                                      "        b.mlp.fast = True\n"),
        "src/poc/engine/fine.py": "class E:\n    def __init__(self, options):\n        self.options = options\n",
        "src/poc/server/config.py": ("def check(v):\n    if v not in ('float32', 'ue8m0'):\n"
                                     "        raise ValueError(v)\n"),
        "benchmarks/diagnostics/x.py": "def f(block):\n    setattr(block.self_attn, 'recipe', 'fp8')\n"
                                       "RECIPES = ['fp8', 'fp8kv', 'bf16']\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setitem(globals(), "SRC", tmp_path / "src")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "USER_ROOTS", [tmp_path / "benchmarks"])
    monkeypatch.setitem(globals(), "option_values", lambda: {"fp8_scales": ("ue8m0", "float32"),
                                                             "attention": ("auto", "fp8", "fp8kv", "bf16")})
    monkeypatch.setitem(globals(), "model_attributes", lambda sources: ({"fused_norm", "n_heads", "fast", "recipe",
                                                                         "forward", "options", "sum_dtype", "w13",
                                                                         "ue8m0", "gluon", "attention"},
                                                                        {"fused_norm", "fast", "recipe", "options",
                                                                         "gluon", "attention"}))
    with pytest.raises(AssertionError) as e:
        test_only_the_model_sets_its_modules_attributes()
    assert ("poc.engine.compute line 3: sets b.mlp.fast" in str(e.value) and "poc.parallel.tp line 3: sets "
            "block.fused_norm" in str(e.value) and "x.py line 2: setattr(block.self_attn, 'recipe', 'fp8')"
            in str(e.value)), str(e.value)
    assert "n_heads" not in str(e.value) and "poc.model" not in str(e.value) and "fine" not in str(e.value)
    with pytest.raises(AssertionError) as e:
        test_the_allowed_values_of_each_option_are_written_once()
    assert "poc.server.config line 2: ('float32', 'ue8m0') (ModelOptions.fp8_scales's values)" in str(e.value)
    assert "x.py line 3: ['fp8', 'fp8kv', 'bf16'] (ModelOptions.attention's values)" in str(e.value)
    assert "poc.model.options" not in str(e.value)
    monkeypatch.undo()  # the reader itself, on the planted model room: the settings are what it sets from options
    attrs, settings = model_attributes({"poc.model.transformer": files["src/poc/model/transformer.py"]})
    assert settings == {"fused_norm", "fast", "options"} and {"n_heads", "forward"} <= attrs - settings
