#!/usr/bin/env bash
# The benchmark suite: any set of workloads, the accuracy check and the GPU diagnostics, on any GPU box. From the
# repo root:
#
#     bash benchmarks/run.sh [--eager] [--tag NAME] [--out-dir DIR] GPU_KIND NAME... [-- FLAGS...]
#     bash benchmarks/run.sh h100 W1 W2 W3 W4 W5            # -> benchmarks/h100/W1.json + W1.png, ...
#     POC_TP_REDUCE=model bash benchmarks/run.sh --tag tp_reduce_model h200x4 W7R -- --batch 32 48
#
# NAME is one of
#   a workload of `python -m poc.bench` (W1 ... W7D: `python -m poc.bench --help`), each in its own process, compiled
#     as the server runs on CUDA (--eager: not), written to DIR/<workload>.json with its plot DIR/<workload>.png;
#   accuracy      `python -m poc.bench --check`: the compiled path against eager (v2 bf16, v1 fp16), DIR/accuracy.json;
#   profile:W4    `python -m poc.bench --profile` of that workload (kernel time by kind), DIR/W4_profile.json;
#   a diagnostic  benchmarks/diagnostics/<name>.py (DIR/<name>.json) or <name>.sh (its output in DIR/<name>.txt).
# GPU_KIND names the folder (h100, h200, h200x2, h200x4, ...); DIR is benchmarks/GPU_KIND unless --out-dir (a
# relative DIR is taken from the repo root).
# --eager adds _eager to the file names, --tag NAME adds _NAME (a variant: another environment, other flags).
# FLAGS after -- go to every command (e.g. -- --batch 64 --warm 2 --timed 8). The environment passes through, and
# poc.bench writes the exact command, with the POC_* and TORCHINDUCTOR_* settings it ran under, into each JSON.
# Every name is attempted; the exit status is the number that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1  # the package; the repo root for tests/ helpers some read
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHON=$PY  # the diagnostics run the same interpreter

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0" >&2; exit 2; }
eager=0 suffix="" dir=""
while [ $# -gt 0 ]; do
  case $1 in
    --eager) eager=1; shift ;;
    --tag) [ $# -ge 2 ] || usage; suffix="_$2"; shift 2 ;;
    --out-dir) [ $# -ge 2 ] || usage; dir=$2; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || usage
kind=$1; shift
names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
flags=("$@")
dir=${dir:-benchmarks/$kind}
[ $eager = 1 ] && suffix="_eager$suffix"
compile=(--compile)
[ $eager = 1 ] && compile=()

workloads=$("$PY" -c "from poc.bench import WORKLOADS; print(' '.join(WORKLOADS))") || exit 2
is_workload() { [[ " $workloads " == *" $1 "* ]]; }
for n in "${names[@]}"; do  # every name checked before anything runs
  w=${n#profile:}
  if ! { is_workload "$w" || [ "$n" = accuracy ] || [ -f "benchmarks/diagnostics/$n.py" ] \
         || [ -f "benchmarks/diagnostics/$n.sh" ]; }; then
    echo "unknown name '$n': a workload ($workloads), accuracy, profile:<workload>, or one of" \
         "$(cd benchmarks/diagnostics && ls -- *.py *.sh | sed 's/\.[a-z]*$//' | tr '\n' ' ')" >&2
    exit 2
  fi
done
mkdir -p "$dir"

failed=0
for n in "${names[@]}"; do
  if [ "$n" = accuracy ]; then
    cmd=("$PY" -m poc.bench --check --out "$dir/accuracy$suffix.json" "${flags[@]}")
  elif [[ $n == profile:* ]]; then
    cmd=("$PY" -m poc.bench --profile --workload "${n#profile:}" "${compile[@]}" "${flags[@]}"
         --out "$dir/${n#profile:}_profile$suffix.json")
  elif is_workload "$n"; then
    cmd=("$PY" -m poc.bench --workload "$n" "${compile[@]}" "${flags[@]}" --out "$dir/$n$suffix.json")
  elif [ -f "benchmarks/diagnostics/$n.py" ]; then
    cmd=("$PY" "benchmarks/diagnostics/$n.py" --out "$dir/$n$suffix.json" "${flags[@]}")
  else
    echo "== bash benchmarks/diagnostics/$n.sh ${flags[*]} > $dir/$n$suffix.txt"
    bash "benchmarks/diagnostics/$n.sh" "${flags[@]}" 2>&1 | tee "$dir/$n$suffix.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "== $n failed" >&2; failed=$((failed + 1)); }
    continue
  fi
  echo "== ${cmd[*]}"
  "${cmd[@]}" || { echo "== $n failed" >&2; failed=$((failed + 1)); }
done
exit $failed
