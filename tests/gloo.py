"""Rank processes for the gloo tests: a script run as `world` processes (argv: rank, world, io dir, *args), each
saving `rank<N>.pt` in the io dir; killed if they outlive the timeout."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from .golden import ROOT


def run_ranks(script: str, io: Path, args: list[str], world: int = 2, timeout: float = 120,
              env: dict | None = None) -> list:
    """Each rank's saved results, once every rank exited 0 (their output is the assertion message otherwise)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1", **(env or {}))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), str(io), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    return [torch.load(Path(io) / f"rank{r}.pt") for r in range(world)]
