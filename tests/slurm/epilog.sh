#!/usr/bin/env bash
# The test cluster's Epilog (tests/slurm/start_cluster.sh): slurmd runs it as root on the node
# once a job has ended, with SLURM_JOB_ID set. It kills every process still alive whose
# environment names the job: one that left the job's process tree, which proctrack/linuxproc
# cannot see (under proctrack/cgroup SLURM's own kill has already reached it, and this finds
# nothing). It always exits 0: a failing Epilog drains the node.
[ -n "${SLURM_JOB_ID:-}" ] || exit 0
# This script and its ancestors carry the job's id as well (slurmd's helper that runs it: a
# SIGKILLed Epilog drained the second node): never them.
ancestors=" "
pid=$$
while [ -n "$pid" ] && [ "$pid" -gt 1 ]; do
    ancestors="$ancestors$pid "
    pid="$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null)"
done
# This node's processes only: the test cluster's second node shares this process table, and
# its network namespace is what sets it apart (on a real cluster every process here is this
# node's). Else each node's Epilog of a two-node job kills the other's.
node_net="$(readlink /proc/$$/ns/net)"
for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"
    case "$ancestors" in *" $pid "*) continue ;; esac
    [ "$(readlink "$dir/ns/net" 2>/dev/null)" = "$node_net" ] || continue
    if { tr '\0' '\n' <"$dir/environ"; } 2>/dev/null | grep -qx "SLURM_JOB_ID=$SLURM_JOB_ID"; then
        kill -KILL "$pid" 2>/dev/null && echo "epilog: job $SLURM_JOB_ID: killed pid $pid ($(tr '\0' ' ' <"$dir/cmdline" 2>/dev/null | cut -c1-200))"
    fi
done
exit 0
