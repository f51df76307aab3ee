"""The shared golden files, one copy: $POC_SHARED, else ../shared beside the checkout (as CI lays it out), else a
shared/ folder inside the checkout (the GPU machine gets the repo with shared/ copied into it)."""

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("POC_SHARED", ROOT.parent / "shared"))
if not (SHARED / "golden").is_dir() and (ROOT / "shared" / "golden").is_dir():
    SHARED = ROOT / "shared"  # a copy inside the checkout (the GPU machine gets only the repo)
GOLDEN = SHARED / "golden"
if not (GOLDEN / "v1_golden.json").is_file():
    raise FileNotFoundError(f"the golden files are not at {GOLDEN}: put the project's shared/ folder beside the "
                            "checkout (as CI does) or set POC_SHARED to it")

V1_GOLDEN = json.loads((GOLDEN / "v1_golden.json").read_text())
V2_GOLDEN = json.loads((GOLDEN / "v2_golden.json").read_text())
V1_SETS = sorted(V1_GOLDEN["sets"])
V2_MODELS = sorted(V2_GOLDEN["models"])


def v2_checkpoint(name: str) -> Path:
    return GOLDEN / "v2_tiny" / name
