#!/usr/bin/env bash
# Stop the test Slurm stood up by tests/slurm/up.sh: only processes whose PIDs
# up.sh recorded, never anything found by name.
#   down.sh            stop every daemon with a PID file under $DIR/run
#   down.sh --started [FILE]  stop only the ones the last up.sh run started
#                             (or whose PIDs FILE lists)
set -uo pipefail

DIR=${DISTDIAG_SLURM_DIR:-/tmp/distdiag-slurm}
export SLURM_CONF=$DIR/etc/slurm.conf

# Reverse start order: compute nodes, controller, accounting, database, munge.
ORDER=(slurmd-n2 slurmd-n1 slurmctld slurmdbd mariadbd munged)
declare -A ONLY=()
# --started FILE: the PIDs listed in FILE (default: what the last up.sh started).
if [[ ${1:-} == --started ]]; then
    while read -r p; do [[ -n $p ]] && ONLY[$p]=1; done <"${2:-$DIR/run/started.pids}" 2>/dev/null || true
fi

pids=()
for name in "${ORDER[@]}"; do
    f=$DIR/run/$name.pid
    [[ -s $f ]] || continue
    pid=$(tr -dc 0-9 <"$f")
    [[ -n $pid && -d /proc/$pid ]] || { rm -f "$f"; continue; }
    if [[ ${1:-} == --started && -z ${ONLY[$pid]:-} ]]; then continue; fi
    # The PID file may be stale and the number reused: check the command.
    if ! tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "${name%%-*}"; then rm -f "$f"; continue; fi
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    # Wait for each before the next: slurmctld flushes to slurmdbd on exit.
    for _ in $(seq 50); do [[ -d /proc/$pid ]] || break; sleep 0.1; done
    if [[ -d /proc/$pid ]]; then kill -KILL "$pid" 2>/dev/null; fi
    rm -f "$f"
done
echo "[slurm down] stopped ${#pids[@]} daemons: ${pids[*]:-}"
