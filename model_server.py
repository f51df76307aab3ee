"""The proof-of-compute model server (PoC v1 and v2 for the Gonka network), aiohttp, one process. The code is
poc.serve; an installed wheel has it as the `poc-server` console script (same flags).

    python model_server.py [--host 127.0.0.1] [--port 18000] [--model DIR|ORG/NAME] [--served-model-name NAME ...] \
        [--dtype auto|float16|bfloat16|float32] [--device cpu|cuda|cuda:N] [--log-level info] [--spool-dir spool] \
        [--tp 1] [--pp 1] [--replicas 1] [--layout auto] [--compile auto|on|off] [--fp8-experts keep|dequant] \
        [--fp8-scales ue8m0|float32] [--attention auto|fp8|fp8kv|bf16] \
        [--compile-at-start v2:BATCH:SEQ_LEN,v1:BATCH] [--version]

Each flag can also be set by an environment variable (POC_HOST, POC_PORT, POC_MODEL, POC_SERVED_MODEL_NAME
(comma-separated), POC_DTYPE, POC_DEVICE, POC_LOG_LEVEL, POC_SPOOL_DIR, POC_TP, POC_PP, POC_REPLICAS, POC_LAYOUT,
POC_COMPILE, POC_FP8_EXPERTS, POC_FP8_SCALES, POC_ATTENTION, POC_COMPILE_AT_START); the flag wins. README.md's Configuration table
says what each does. Without --model it serves PoC v1 (the random model is built from each request's params); with
--model (a directory, or a Hugging Face repo id found in the local cache, offline) it loads that checkpoint at start
and serves PoC v2 for it, and v1. --layout auto picks --tp/--pp/--replicas from the model and the visible GPUs.
--compile-at-start runs one batch of each listed shape through the engine (compiled on CUDA) before the
one "Application startup complete." line it logs when it can take work. SIGTERM stops the jobs, ends open streams
with a final line and exits 0. An unrecoverable start-up failure (bad flags, an unusable --spool-dir, a repo id not
in the cache: exit 2; the port in use: exit 1; the --model checkpoint failing to load: exit 3 within seconds, or
with POC_FATAL_KEEPALIVE=1 (scripts/docker_entrypoint.sh sets it) the server stays up and /health answers 503 with
the reason) is one line on stderr starting with FATAL ("Error: POC-FATAL"), the on_error pattern of worker.py, so
that the Vast PyWorker marks the worker failed at once. The log formatter turns every "Error:" of a logged event
into "Error -", so no handled event (whatever text a request carries) can print it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # runs from a checkout without `pip install -e .`

from poc.serve import FATAL, main  # noqa: E402,F401  (FATAL: worker.py's on_error pattern, printed only there)

if __name__ == "__main__":
    sys.exit(main())
