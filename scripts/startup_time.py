"""How long the command-line tools take to answer --help, --version and a bad argument, in a fresh process each
(issue 17: under 1.5 s on the 2-core development machine). Prints one line per command, the best of --runs, and
the heavy modules (torch, scipy.stats, torch._dynamo) each one imported (none is expected).

    python scripts/startup_time.py [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "torch._dynamo", "scipy.stats")
COMMANDS = [
    ["-m", "poc", "--help"],
    ["-m", "poc", "--version"],
    ["-m", "poc", "--bogus"],
    ["-m", "poc", "v1", "--block-hash", "h", "--public-key", "k", "--nonces", "0-3", "--params", "{not json"],
    ["-m", "poc", "v2", "--block-hash", "h", "--public-key", "k", "--nonces", "0-3", "--model", "/no/such/dir",
     "--seq-len", "8"],
    ["-m", "poc.bench", "--help"],
    ["-m", "poc.bench", "--batch", "0"],
    ["model_server.py", "--help"],
    ["model_server.py", "--version"],
    ["model_server.py", "--port", "nope"],
]


def imported_heavy(args: list[str], env: dict) -> list[str]:
    """The heavy modules a command imported (python -X importtime lists every import on stderr)."""
    p = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    names = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    return sorted(names & set(HEAVY))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    rows = []
    for args in COMMANDS:
        times = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, *args], capture_output=True, cwd=ROOT, env=env, timeout=300)
            times.append(time.perf_counter() - t0)
        row = {"command": "python " + " ".join(args), "exit": p.returncode, "best_s": round(min(times), 3),
               "heavy_imports": imported_heavy(args, env)}
        rows.append(row)
        print(f"{row['best_s']:6.2f} s  exit {row['exit']}  {row['command']}"
              + (f"  (imported {', '.join(row['heavy_imports'])})" if row["heavy_imports"] else ""), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"python": sys.version.split()[0], "cpus": os.cpu_count(), "rows": rows,
                                            "command": "python " + " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
