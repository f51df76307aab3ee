#!/usr/bin/env bash
# Start a run on a fresh log: the Vast PyWorker reads MODEL_LOG from its start, so a line left by an earlier run
# (a stale "Error: POC-FATAL") would mark a healthy restarted worker failed. Moves a non-empty PATH to PATH.1
# (PATH.1 to PATH.2, ... up to PATH.5, as Vast's own start scripts keep the old log beside the new one) and
# creates PATH empty; prints the path used (./logs/server.log when PATH's directory is not writable).
#
#   MODEL_LOG=$(scripts/fresh_log.sh "$MODEL_LOG")
set -euo pipefail
log=${1:?usage: scripts/fresh_log.sh PATH}
if ! { mkdir -p "$(dirname "$log")" && touch "$log"; } 2>/dev/null; then
    log=$(cd "$(dirname "$0")/.." && pwd)/logs/server.log
    mkdir -p "$(dirname "$log")"
    touch "$log"
fi
if [[ -s $log ]]; then
    for i in 4 3 2 1; do
        if [[ -e $log.$i ]]; then mv -f "$log.$i" "$log.$((i + 1))"; fi
    done
    mv -f "$log" "$log.1"
    : > "$log"
fi
echo "$log"
