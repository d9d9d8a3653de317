#!/usr/bin/env bash
# The test cluster's Epilog (tests/slurm/start_cluster.sh): slurmd runs it as root on the node
# once a job has ended, with SLURM_JOB_ID set. It kills every process still alive whose
# environment names the job: one that left the job's process tree, which proctrack/linuxproc
# cannot see (under proctrack/cgroup SLURM's own kill has already reached it, and this finds
# nothing). It always exits 0: a failing Epilog drains the node.
[ -n "${SLURM_JOB_ID:-}" ] || exit 0
for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"
    [ "$pid" = "$$" ] && continue
    if tr '\0' '\n' <"$dir/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$SLURM_JOB_ID"; then
        kill -KILL "$pid" 2>/dev/null && echo "epilog: job $SLURM_JOB_ID: killed pid $pid ($(tr '\0' ' ' <"$dir/cmdline" 2>/dev/null | cut -c1-200))"
    fi
done
exit 0
