"""The shared golden files: $POC_SHARED, else ../shared beside the checkout (as CI lays it out), else a copy inside
the checkout (shared/ on the GPU machine, which gets only the repo), else tests/golden_copy, a byte-for-byte copy
committed so that a bare clone runs too (test_golden_copy_matches_shared fails when it drifts from ../shared)."""

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("POC_SHARED", ROOT.parent / "shared"))
COPY = ROOT / "tests" / "golden_copy"
if not (SHARED / "golden").is_dir() and (ROOT / "shared" / "golden").is_dir():
    SHARED = ROOT / "shared"  # a copy inside the checkout (the GPU machine gets only the repo)
GOLDEN = SHARED / "golden" if (SHARED / "golden").is_dir() or "POC_SHARED" in os.environ else COPY
if not (GOLDEN / "v1_golden.json").is_file():
    raise FileNotFoundError(f"the golden files are not at {GOLDEN}: put the project's shared/ folder beside the "
                            "checkout (as CI does) or set POC_SHARED to it")

V1_GOLDEN = json.loads((GOLDEN / "v1_golden.json").read_text())
V2_GOLDEN = json.loads((GOLDEN / "v2_golden.json").read_text())
V1_SETS = sorted(V1_GOLDEN["sets"])
V2_MODELS = sorted(V2_GOLDEN["models"])


def v2_checkpoint(name: str) -> Path:
    return GOLDEN / "v2_tiny" / name
