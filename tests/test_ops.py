"""The operator's path (issue 17): restarts, fatal start-ups, installs, start-up time.

- a restarted container (scripts/docker_entrypoint.sh -> start_server.sh) whose log still holds the previous run's
  `Error: POC-FATAL` line: the log is made fresh before the PyWorker reads it, and the fake autoscaler sees the
  worker loaded with no error;
- a fatal start-up (a --model that does not exist) exits 3 by default (POC_FATAL_KEEPALIVE=1 keeps it up:
  tests/test_worker.py);
- scripts/fresh_log.sh keeps the old logs beside the new one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .fakes import ROOT, ServerProcess, ThreadLoop, free_port
from .golden import v2_checkpoint
from .servers import PARAMS_A, QWEN3, server_config, v1_request, wait_status

FATAL = "Error: POC-FATAL"


def wait_for(cond, timeout: float, what: str, log=None) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}\n{log() if log else ''}"
        time.sleep(0.05)


def copy_repo(dst: Path, *extra: str) -> Path:
    """The files a start needs (scripts, entry files, src), without caches: the scripts cd to their checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for d in ("scripts", "src", *[e for e in extra if (ROOT / e).is_dir()]):
        shutil.copytree(ROOT / d, dst / d, ignore=ignore)
    for f in ("model_server.py", "worker.py", "start_server.sh", "requirements.txt", "pyproject.toml",
              *[e for e in extra if (ROOT / e).is_file()]):
        shutil.copy2(ROOT / f, dst / f)
    return dst


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this test started (entrypoint -> server, tee, worker.py), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # worker.py and tee are in the same group and may outlive the server
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


# --------------------------------------------------------------------------------------------------
# restart safety


def test_fresh_log_rotates_the_old_logs_beside_the_new_one(tmp_path):
    log = tmp_path / "model" / "server.log"
    script = ROOT / "scripts/fresh_log.sh"
    out = subprocess.run([str(script), str(log)], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(log) and log.read_text() == ""  # created, nothing to rotate
    assert not (tmp_path / "model" / "server.log.1").exists()
    for run in range(1, 8):
        log.write_text(f"run {run}\n")
        subprocess.run([str(script), str(log)], capture_output=True, check=True)
        assert log.read_text() == ""
    kept = sorted(p.name for p in log.parent.iterdir())
    assert kept == ["server.log", "server.log.1", "server.log.2", "server.log.3", "server.log.4", "server.log.5"]
    assert [(log.parent / f"server.log.{i}").read_text() for i in (1, 5)] == ["run 7\n", "run 3\n"]
    subprocess.run([str(script), str(log)], capture_output=True, check=True)  # an empty log is not rotated
    assert (log.parent / "server.log.1").read_text() == "run 7\n"


def test_a_restarted_worker_is_not_failed_by_the_previous_runs_fatal_line(tmp_path):
    """docker_entrypoint.sh on a Vast worker: the PyWorker (real vastai 1.9.1) and the model server, with the log
    of a previous run that ended in a FATAL line; the autoscaler must see the worker loaded and no error."""
    pytest.importorskip("vastai.serverless.server.worker")
    from .fakes import FakeAutoscaler

    repo = copy_repo(tmp_path / "repo")
    log = tmp_path / "logs" / "server.log"
    log.parent.mkdir()
    stale = f"{FATAL} model_server: model load failed: the previous run's failure\n"
    log.write_text("2026-11-22 10:00:00 INFO poc.server: loading /models/x on cuda\n" + stale)
    loop = ThreadLoop()
    RSA = pytest.importorskip("Crypto.PublicKey.RSA")
    autoscaler = FakeAutoscaler(RSA.generate(2048).publickey().export_key().decode())  # a key it can parse
    loop.run(autoscaler.start())
    port, http_port, server_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POC_", "VAST_", "TORCHINDUCTOR_", "TRITON_"))}
    env.update(PYTHONUNBUFFERED="1", CONTAINER_ID="7", REPORT_ADDR=autoscaler.url, WORKER_PORT=str(port),
               WORKER_HTTP_PORT=str(http_port), PUBLIC_IPADDR="127.0.0.1", **{f"VAST_TCP_PORT_{port}": str(port)},
               UNSECURED="true", MODEL_LOG=str(log), POC_PORT=str(server_port), POC_WORKER_HOST="127.0.0.1",
               POC_START_PYWORKER="1", POC_PYTHON=sys.executable, POC_DEVICE="cpu",
               POC_SPOOL_DIR=str(tmp_path / "spool"), POC_BENCH_PARAMS=json.dumps(PARAMS_A),
               POC_BENCH_NONCES="400", POC_BENCH_BATCH="100", POC_BENCH_RUNS="1")
    out = open(tmp_path / "entrypoint.out", "wb")
    proc = subprocess.Popen(["bash", str(repo / "scripts/docker_entrypoint.sh")], cwd=repo, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    pyworker_log = log.parent / "pyworker.log"

    def logs() -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in (tmp_path / "entrypoint.out", log, pyworker_log) if p.exists())

    def loaded() -> bool:
        assert proc.poll() is None, logs()
        return pyworker_log.exists() and "marking model as loaded" in pyworker_log.read_text(errors="replace")

    try:
        wait_for(loaded, 120, "the PyWorker to mark the model loaded", logs)
        n = len(autoscaler.status)
        wait_for(lambda: len(autoscaler.status) > n, 20, "a worker_status report after loading", logs)
        reports = [d for _, d in autoscaler.status]
        assert all(d["error_msg"] == "" for d in reports), [d["error_msg"] for d in reports]
        assert reports[-1]["loadtime"] > 0 and reports[-1]["max_perf"] > 0
        assert (log.parent / "server.log.1").read_text().endswith(stale)  # the old log kept beside the new one
        text = log.read_text()
        assert FATAL not in text and "Application startup complete." in text
        # the entrypoint's default on Vast: the benchmark's shape run (compiled on CUDA) before the readiness line
        assert -1 < text.find("compile at start: v1 batch 100 dim 64") < text.find("Application startup complete.")
    finally:
        stop_group(proc)
        out.close()
        loop.run(autoscaler.stop())
        loop.close()


# --------------------------------------------------------------------------------------------------
# a fatal start-up


def test_a_fatal_start_exits_nonzero_by_default(tmp_path):
    s = ServerProcess(tmp_path / "s.log", "--model", str(tmp_path / "missing"), "--spool-dir", str(tmp_path / "sp"),
                      env={"POC_FATAL_KEEPALIVE": "0"})
    try:
        wait_for(lambda: FATAL in s.text() or s.proc.poll() is not None, 90, "the fatal line", s.text)
        t_fatal = time.monotonic()
        rc = s.proc.wait(10)  # the bound: exit within 10 s of the fatal line
        print(f"\n[fatal start] exit {rc} {time.monotonic() - t_fatal:.2f} s after the FATAL line")
    finally:
        s.terminate()
    assert rc == 3, s.text()
    fatal = [line for line in s.text().splitlines() if FATAL in line]
    assert len(fatal) == 1 and "does not exist" in fatal[0] and "Application startup complete." not in s.text()


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_server_goes_on(tmp_path):
    """A hung server is diagnosed without stopping it: kill -USR1 writes its threads' stacks into the log."""
    import urllib.request

    s = ServerProcess(tmp_path / "s.log", "--spool-dir", str(tmp_path / "sp"))
    try:
        wait_for(lambda: "Application startup complete." in s.text(), 90, "the readiness line", s.text)
        assert "most recent call first" not in s.text()
        os.kill(s.proc.pid, signal.SIGUSR1)
        wait_for(lambda: "most recent call first" in s.text(), 30, "the stacks", s.text)
        with urllib.request.urlopen(f"{s.url}/health", timeout=30) as r:
            assert r.status == 200
        assert s.proc.poll() is None
    finally:
        rc = s.terminate()
    assert rc == 0, s.text()
    assert "Thread 0x" in s.text() and "serve.py" in s.text()


def test_fatal_keepalive_setting_is_checked(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "model_server.py"), "--device", "cpu", "--spool-dir",
                        str(tmp_path / "sp")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "POC_FATAL_KEEPALIVE": "maybe"})
    assert p.returncode == 2 and "POC_FATAL_KEEPALIVE must be 0 or 1" in p.stderr


# --------------------------------------------------------------------------------------------------
# start-up time of the tools: arguments are checked before torch, dynamo and scipy.stats are imported


def _startup_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("startup_time", ROOT / "scripts/startup_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_version_and_bad_arguments_import_no_heavy_module():
    """Each command of scripts/startup_time.py (which prints the seconds) answers without importing torch,
    torch._dynamo or scipy.stats: python -X importtime lists every module a process imported."""
    st = _startup_script()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    assert st.imported_heavy(["-c", "import torch, scipy.stats"], env) == ["scipy.stats", "torch"]  # it can see them
    for args in st.COMMANDS:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        bad = "--help" not in args and "--version" not in args
        assert p.returncode == (2 if bad else 0), (args, p.stderr)
        if bad:
            assert p.stderr.strip() and "Traceback" not in p.stderr, (args, p.stderr)
        assert st.imported_heavy(args, env) == [], args


def test_version_flags_say_the_package_version():
    import poc

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for args, name in ((["-m", "poc"], "poc"), (["-m", "poc.bench"], "poc.bench"),
                       ([str(ROOT / "model_server.py")], "poc-server")):
        p = subprocess.run([sys.executable, *args, "--version"], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0 and p.stdout.strip() == f"{name} {poc.__version__}", (args, p.stdout, p.stderr)


# --------------------------------------------------------------------------------------------------
# installs


def test_two_ensure_venv_started_together_both_succeed(tmp_path):
    """The README's two commands on a fresh clone both run scripts/ensure_venv.sh: the second waits on the lock
    and finds the environment ready (before the lock it failed with "No module named pip"). A throwaway copy with
    requirement files that name nothing, so pip needs no network (PIP_NO_INDEX); pip's own output is shown."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "src" / "poc").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts/ensure_venv.sh", repo / "scripts/ensure_venv.sh")
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "src/poc/__init__.py").write_text('__version__ = "test"\n')
    (repo / "requirements.txt").write_text("# nothing to install: the test runs offline\n")
    (repo / "requirements-worker.txt").write_text("# nothing\n")
    (repo / "requirements-test.txt").write_text("-r requirements.txt\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHON": sys.executable, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    procs = [subprocess.Popen(["bash", "scripts/ensure_venv.sh"], cwd=repo, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    text = "\n".join(outs)
    assert text.count("ensure_venv: creating .venv") == 1 and text.count("ensure_venv: .venv ready") == 1, outs
    assert "Requirement already satisfied: pip" in text  # pip's own output, not -q silence
    p = subprocess.run([str(repo / ".venv/bin/python"), "-c", "import poc; print(poc.__version__, poc.__file__)"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60, env={**env, "PYTHONPATH": ""})
    assert p.stdout.split() == ["test", str(repo / "src/poc/__init__.py")], p.stderr
    stamps = list((repo / ".venv").glob(".installed-*"))
    assert len(stamps) == 1
    again = subprocess.run(["bash", "scripts/ensure_venv.sh"], cwd=repo, env=env, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and again.stdout == again.stderr == ""  # installed: a quiet no-op


def test_the_pyworker_needs_no_torch():
    """requirements-worker.txt pulls neither torch nor the model server's pins, and worker.py imports neither."""
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "requirements-worker.txt").read_text().splitlines()]
    names = {ln.split("==")[0].split(">=")[0].lower() for ln in lines if ln}
    assert "vastai" in names and not names & {"torch", "numpy", "scipy", "-r requirements.txt"}
    assert not any(ln.startswith("-r") for ln in lines)
    assert "vastai" not in (ROOT / "requirements.txt").read_text()
    pytest.importorskip("vastai.serverless.server.worker")
    p = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import worker; "
                        "print(sorted(m for m in ('torch', 'numpy', 'poc') if m in sys.modules))", str(ROOT)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


# --------------------------------------------------------------------------------------------------
# --model <Hugging Face repo id>, from the local cache only

TINY = v2_checkpoint("qwen3")  # where tests/golden.py finds the shared files ($POC_SHARED, ../shared, ./shared)
REV = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(root: Path, repo: str = "TestOrg/tiny-qwen3") -> Path:
    """The layout huggingface_hub writes: models--Org--Name/{refs/main, snapshots/<rev>/<files>}."""
    d = root / f"models--{repo.replace('/', '--')}"
    snap = d / "snapshots" / REV
    snap.mkdir(parents=True)
    for f in TINY.iterdir():
        shutil.copyfile(f, snap / f.name)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(REV)
    return snap


def test_model_repo_id_resolves_from_the_local_hub_cache_only(tmp_path, monkeypatch):
    if not TINY.is_dir():
        pytest.skip(f"no golden checkpoint at {TINY}")
    from poc.errors import InputError
    from poc.hub import resolve_model

    snap = make_hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("TestOrg/tiny-qwen3") == str(snap)
    assert resolve_model(str(TINY)) == str(TINY) and resolve_model("random:tiny") == "random:tiny"
    assert resolve_model(str(tmp_path / "no" / "dir")) == str(tmp_path / "no" / "dir")  # the loader says it
    with pytest.raises(InputError) as e:
        resolve_model("TestOrg/not-downloaded")
    assert str(tmp_path / "hub") in e.value.message and "TestOrg/not-downloaded" in e.value.message


async def test_server_serves_a_repo_id_from_the_hub_cache(tmp_path):
    if not TINY.is_dir():
        pytest.skip(f"no golden checkpoint at {TINY}")
    import aiohttp

    make_hub_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    s = ServerProcess(tmp_path / "s.log", "--model", "TestOrg/tiny-qwen3", "--spool-dir", str(tmp_path / "sp"),
                      env=env)
    try:
        await s.wait_ready(90)
        body = {"block_hash": "hub", "block_height": 1, "public_key": "k", "node_id": 0, "node_count": 1,
                "batch_size": 4, "max_nonces": 8, "params": {"model": "TestOrg/tiny-qwen3", "seq_len": 8, "k_dim": 12}}
        async with aiohttp.ClientSession() as http:
            async with http.get(s.url + "/health") as r:
                health = await r.json()
            async with http.post(s.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                lines = [json.loads(x) for x in (await r.read()).splitlines()]
        # named as /v1/models names it (the repo id), not by its snapshot directory
        assert health["state"] == "ready" and health["model"] == "TestOrg/tiny-qwen3", health
        assert lines[-1]["status"] == "done" and lines[-1]["computed"] == 8, lines[-1]
        assert "\r" not in s.text()  # no progress bar in the log: its \r updates made unreadable lines
    finally:
        assert s.terminate() == 0, s.text()
    missing = subprocess.run([sys.executable, str(ROOT / "model_server.py"), "--device", "cpu", "--model",
                              "TestOrg/not-downloaded", "--spool-dir", str(tmp_path / "sp")], capture_output=True,
                             text=True, timeout=60, env={**os.environ, **env})
    assert missing.returncode == 2 and missing.stderr.startswith(f"{FATAL} model_server: bad input: --model")
    assert str(tmp_path / "hub") in missing.stderr


# --------------------------------------------------------------------------------------------------
# /metrics: what a Prometheus user expects of a target


async def test_metrics_parse_and_carry_process_latency_queue_and_build_families(aiohttp_client, aiohttp_server):
    from aiohttp import web
    from prometheus_client.parser import text_string_to_metric_families

    import torch
    from poc import __version__
    from poc.server.app import create_app
    from poc.server.context import sender_key

    received = []

    async def generated(request):
        received.append(await request.json())
        return web.json_response({})

    receiver = web.Application()
    receiver.router.add_post("/cb/generated", generated)
    rx = await aiohttp_server(receiver)
    client = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(client)
    r = await client.post("/generate", json=v1_request(max_nonces=15, batch_size=5))
    assert r.status == 200 and json.loads((await r.read()).splitlines()[-1])["computed"] == 15
    sender = client.server.app[sender_key]
    assert sender.submit("generated", str(rx.make_url("/cb")), {"nonces": [1]}, "metrics-test-1")

    async def scrape() -> dict:
        r = await client.get("/metrics")
        assert r.status == 200
        return {f.name: f for f in text_string_to_metric_families(await r.text())}  # raises on malformed text

    t0 = time.monotonic()
    while not received or sender.pending:
        assert time.monotonic() - t0 < 10, "the callback was not delivered"
        await asyncio.sleep(0.02)
    fams = await scrape()

    def value(family: str, sample: str, **labels) -> float:
        return next(s.value for s in fams[family].samples if s.name == sample and all(
            s.labels.get(k) == v for k, v in labels.items()))

    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds", "python_info",
                 "python_gc_objects_collected"):
        assert name in fams, name  # the default collectors, on the app's own registry
    assert fams["poc_batch_seconds"].type == "histogram"
    assert value("poc_batch_seconds", "poc_batch_seconds_count", protocol="v1") == 3  # 15 nonces, 5 a batch
    assert value("poc_batch_seconds", "poc_batch_seconds_bucket", protocol="v1", le="+Inf") == 3
    assert value("poc_batch_seconds", "poc_batch_seconds_sum", protocol="v1") > 0
    assert value("poc_callback_post_seconds", "poc_callback_post_seconds_count", kind="generated") == 1
    assert value("poc_callback_delivery_seconds", "poc_callback_delivery_seconds_count", kind="generated") == 1
    assert value("poc_pow_queue_jobs", "poc_pow_queue_jobs") == 0
    assert value("poc_pow_queued_nonces", "poc_pow_queued_nonces") == 0
    assert value("poc_callbacks_pending", "poc_callbacks_pending") == 0
    build = next(s for s in fams["poc_build_info"].samples if s.name == "poc_build_info")  # text 0.0.4: a gauge
    assert build.value == 1 and build.labels == {"version": __version__, "torch": torch.__version__,
                                                 "cuda": torch.version.cuda or "none", "device": "cpu"}


# --------------------------------------------------------------------------------------------------
# compile at start: the setting, and its batches run through the engine before the readiness line


def test_compile_at_start_setting_is_parsed_and_checked():
    from poc.errors import InputError
    from poc.protocol.v1 import PARAMS_V2
    from poc.server.config import parse_args
    from poc.server.warm_start import WarmShape

    cfg = parse_args(["--model", "m", "--compile-at-start", "v2:256:256, v1:64"], env={})
    assert cfg.compile_at_start == (WarmShape("v2", 256, '{"seq_len": 256, "k_dim": 12}'),
                                    WarmShape("v1", 64, json.dumps(PARAMS_V2.to_json())))
    env = {"POC_COMPILE_AT_START": json.dumps([{"batch_size": 8, "params": PARAMS_A, "dtype": "float32"},
                                               {"batch_size": 2, "params": {"seq_len": 16, "k_dim": 4}}])}
    shapes = parse_args(["--model", "m"], env=env).compile_at_start
    assert [(s.protocol, s.batch_size, s.dtype) for s in shapes] == [("v1", 8, "float32"), ("v2", 2, "float16")]
    assert json.loads(shapes[0].params) == PARAMS_A and json.loads(shapes[1].params) == {"seq_len": 16, "k_dim": 4}
    assert parse_args([], env={}).compile_at_start == ()
    for bad, words in (("v2:8:64", "needs --model"), ("v3:1", "is not v2:BATCH"), ("v1:0", "1..4096"),
                       ("[{\"batch_size\": 4}]", "each item"), ("[1", "not valid JSON"),
                       ('[{"batch_size": 4, "params": {"dim": 64}}]', "missing --compile-at-start params key")):
        with pytest.raises(InputError) as e:
            parse_args(["--compile-at-start", bad], env={})
        assert words in e.value.message, (bad, e.value.message)


def test_compile_at_start_batches_time_the_engine_alone(caplog):
    """"batches": N runs N batches of the shape and logs the engine's own rate after the first (what
    benchmarks/diagnostics/serve_layouts.py compares the routes with)."""
    import logging
    import time

    from poc.engine.jobs import BatchResult, JobSummary
    from poc.errors import InputError
    from poc.server import warm_start
    from poc.server.config import parse_args

    (shape,) = parse_args(["--model", "m", "--compile-at-start",
                           '[{"batch_size": 4, "params": {"seq_len": 16}, "batches": 5}]'], env={}).compile_at_start
    assert shape.batches == 5 and warm_start._job(shape).limits.max_nonces == 20
    with pytest.raises(InputError, match="batches must be an integer in 1..1000"):
        parse_args(["--model", "m", "--compile-at-start", '[{"batch_size": 4, "params": {"seq_len": 16}, '
                                                           '"batches": 0}]'], env={})

    class FakeEngine:
        compile_v1 = compile_v2 = False
        replicas, last_job_stats = 1, None

        def require_v2(self):
            return type("Info", (), {"cfg": type("Cfg", (), {"max_seq_len": 64, "dim": 64})})()

        def run(self, job, emit, stop, claim=None):
            n = 0
            while n < job.limits.max_nonces:
                time.sleep(0.02)
                emit(BatchResult(index=n // 4 + 1, nonces=list(range(n, n + 4)), elapsed=0.0, batch_seconds=0.02))
                n += 4
            return JobSummary("max_nonces", n // 4, n, 0.1)

    with caplog.at_level(logging.INFO, logger="poc.server"):
        warm_start.run(FakeEngine(), (shape,))
    line = next(m for m in caplog.messages if "compile at start:" in m)
    assert "20 nonces in 5 batch(es)" in line, line
    rate = float(line.split("the engine alone after each replica's first batch: ")[1].split()[0])
    assert 50 < rate < 210, line  # 16 nonces over 4 steps of ~0.02 s: ~200/s, less on a loaded machine


async def test_compile_at_start_warms_every_replica_and_every_stage(aiohttp_client, caplog):
    """Two replicas of pp=2 on gloo (issue 34: on four H200 the first job found replica 2 cold): each replica computes
    a batch of the shape through both its stages before the server is ready, and the log says so per replica."""
    import logging

    from poc.server import warm_start
    from poc.server.app import create_app
    from poc.server.context import engine_key

    cfg = server_config(model=QWEN3, replicas=2, pp=2, compile_at_start=warm_start.parse("v2:3:16", QWEN3))
    with caplog.at_level(logging.INFO, logger="poc.server"):
        client = await aiohttp_client(create_app(cfg))
        await wait_status(client, timeout=180)
    warm = [m for m in caplog.messages if m.startswith("compile at start:")]
    assert len(warm) == 3 and "v2 batch 3 seq_len 16, 6 nonces in 2 batch(es)" in warm[0], warm
    for r, line in enumerate(warm[1:], 1):
        assert line.startswith(f"compile at start: v2 batch 3 seq_len 16, replica {r}/2 warm: its 2 rank(s) "
                               f"({2 * r - 2}-{2 * r - 1}, 2 stage(s)) ran 1 batch(es) each"), line
    stats = client.app[engine_key].last_job_stats
    assert [x["results"] for x in stats["replicas"]] == [1, 1]
    assert sorted((x["rank"], x["stage"], x["batches"]) for x in stats["ranks"]) == [(0, 0, 1), (1, 1, 1), (2, 0, 1),
                                                                                      (3, 1, 1)]


def test_compile_at_start_names_a_replica_left_cold(caplog):
    """A rank that ran no batch of the shape (an engine dealing the job badly) is a warning naming it."""
    import logging

    from poc.server import warm_start

    class Engine:
        replicas = 2
        last_job_stats = {"replicas": [{"results": 2}, {"results": 0}],
                          "ranks": [{"rank": r, "stage": r % 2, "batches": 2 if r < 2 else 0} for r in range(4)]}

        def parallel_dims(self):
            return 1, 2, 4

    with caplog.at_level(logging.INFO, logger="poc.server"):
        warm_start._log_replicas(Engine(), warm_start.parse("v2:3:16", "m")[0])
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert "replica 1/2 warm: its 2 rank(s) (0-1, 2 stage(s)) ran 2 batch(es) each" in caplog.messages[0]
    assert "replica 2/2 NOT warm: rank(s) 2, 3 ran no batch" in caplog.messages[1]


async def test_compile_at_start_runs_its_batches_before_the_readiness_line(tmp_path):
    """On the CPU compile is off: the batches run all the same, through the engine, before the line."""
    s = ServerProcess(tmp_path / "s.log", "--model", QWEN3, "--spool-dir", str(tmp_path / "sp"),
                      "--compile-at-start", "v2:6:16,v2:3:8", env={"POC_LOG_LEVEL": "info"})
    try:
        await s.wait_ready(90)
    finally:
        assert s.terminate() == 0, s.text()
    lines = s.text().splitlines()
    ready = next(i for i, line in enumerate(lines) if "Application startup complete." in line)
    warm = [(i, line) for i, line in enumerate(lines) if "compile at start:" in line]
    assert [i < ready for i, _ in warm] == [True, True], lines
    assert "v2 batch 6 seq_len 16, 6 nonces in 1 batch(es)" in warm[0][1]
    assert "v2 batch 3 seq_len 8, 3 nonces in 1 batch(es)" in warm[1][1] and "compile is off" in warm[1][1]


async def test_a_failed_warm_up_is_logged_and_the_server_starts(tmp_path):
    s = ServerProcess(tmp_path / "s.log", "--model", QWEN3, "--spool-dir", str(tmp_path / "sp"),
                      "--compile-at-start", "v2:2:100000")  # past the tiny model's max_position_embeddings
    try:
        await s.wait_ready(90)
    finally:
        assert s.terminate() == 0, s.text()
    warn = [line for line in s.text().splitlines() if "compile at start:" in line]
    assert len(warn) == 1 and "WARNING" in warn[0] and "failed" in warn[0] and FATAL not in s.text()
