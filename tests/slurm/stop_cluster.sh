#!/usr/bin/env bash
# Stop the test cluster tests/slurm/start_cluster.sh started: the slurmds, slurmctld and munged, each
# by its pid file, SIGTERM then SIGKILL after 10 s. `.ci/run` calls it when the tests end, so that
# no daemon of the run outlives it (the next start_cluster.sh starts them again in seconds).
# Idempotent: a daemon that is not running is skipped.
set -uo pipefail
stop() {
    local pidfile="$1" pid
    [ -s "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
}
for pidfile in /run/slurmd-*.pid /run/slurmd.pid; do stop "$pidfile"; done
stop /run/slurmctld.pid
stop /run/munge/munged.pid
exit 0
