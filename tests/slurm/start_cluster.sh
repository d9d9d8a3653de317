#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests/integration/test_slurm.py (and by hand:
# `sudo tests/slurm/start_cluster.sh`). Idempotent: installs Debian's slurm-wlm and munge
# if missing, writes /etc/slurm/slurm.conf if it differs, starts munged, slurmctld and slurmd
# if they are not running, and waits until the node is idle. Prints the partition name.
#
# A cancelled job is dead, every process of it. proctrack/linuxproc kills the processes it finds
# under the job's steps by their parent pids, at once; a process that left the tree (a daemonized
# child, one re-parented to init when its parent died first) it cannot see: a SIGKILLed shard's
# inner Snakemake lived on. The Epilog (tests/slurm/epilog.sh) kills every process whose
# environment names the job once the job has ended. proctrack/cgroup (cgroup v1's freezer here,
# EAGLEFLOW_SLURM_PROCTRACK=cgroup) would see them all, but on this kind of machine's legacy
# freezer a SIGKILLed step ran on for 7 s after `scancel` (the killed generate shard finished
# every request it had left), so linuxproc and the Epilog are the default.
#
# Accounting is off (no slurmdbd): `sacct` cannot answer, so Snakemake's slurm executor must
# poll with `--slurm-status-command squeue`. MinJobAge keeps finished jobs visible to squeue
# for an hour: long enough for that (the plugin falls back to sacct when MinJobAge is under 3x
# its first poll delay) and for a test to read every job of a run back.
set -euo pipefail

PARTITION="${EAGLEFLOW_SLURM_PARTITION:-eagleflow-test}"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
STATE=/var/lib/slurm
LOGS=/var/log/slurm
WAIT_S=120

die() { echo "start_cluster: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (installs packages and starts munged, slurmctld, slurmd)"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
    echo "start_cluster: installing slurm-wlm and munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends slurm-wlm munge >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends slurm-wlm munge >&2; } \
        || die "apt-get could not install slurm-wlm and munge"
fi

# munge: the key the package made, or a new one; munged as root needs --force.
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    munged --force
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n </dev/null | unmunge >/dev/null || die "munged does not answer"
fi

HOST="$(hostname -s)"
CPUS="$(nproc)"
# Declare less memory than the machine has: slurmd drains a node whose RealMemory exceeds
# what it finds.
MEM_MB="$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"

freezer_writable() {
    local probe=/sys/fs/cgroup/freezer/eagleflow-probe.$$
    mkdir "$probe" 2>/dev/null || return 1
    rmdir "$probe"
}
EPILOG="$(cd "$(dirname "$0")" && pwd)/epilog.sh"
if [ "${EAGLEFLOW_SLURM_PROCTRACK:-linuxproc}" = cgroup ]; then
    freezer_writable || die "EAGLEFLOW_SLURM_PROCTRACK=cgroup: no writable cgroup v1 freezer hierarchy here"
    PROCTRACK=proctrack/cgroup
    CGROUP_CONF="CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup"
else
    PROCTRACK=proctrack/linuxproc
    CGROUP_CONF=""
fi

mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd" "$LOGS"
NEW_CONF="$(cat <<CONF
# Written by eagleflow tests/slurm/start_cluster.sh: one node, no accounting, for tests.
ClusterName=eagleflow
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=$PROCTRACK
Epilog=$EPILOG
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=3600
SchedulerType=sched/backfill
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
)"

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

CGROUP_FILE="$CONF_DIR/cgroup.conf"
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW_CONF" ] || [ "$(cat "$CGROUP_FILE" 2>/dev/null)" != "$CGROUP_CONF" ]; then
    printf '%s\n' "$NEW_CONF" >"$CONF"
    if [ -n "$CGROUP_CONF" ]; then printf '%s\n' "$CGROUP_CONF" >"$CGROUP_FILE"; else rm -f "$CGROUP_FILE"; fi
    # A changed config needs restarted daemons; stop the ones this script started before.
    for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
        if running "$pidfile"; then
            pid="$(cat "$pidfile")"
            kill "$pid"
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
    done
fi

running /run/slurmctld.pid || slurmctld
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.2; done
scontrol ping | grep -q "is UP" || die "slurmctld does not answer; see $LOGS/slurmctld.log"
running /run/slurmd.pid || slurmd

deadline=$((SECONDS + WAIT_S))
while :; do
    state="$(sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -1)"
    case "$state" in
        idle | mixed | allocated) break ;;
        down* | drain* | drained*)
            # Left over from an earlier start (e.g. a node that was not responding).
            scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
    esac
    [ "$SECONDS" -lt "$deadline" ] || die "node $HOST is '$state' after ${WAIT_S}s; see $LOGS/slurmd.log and $LOGS/slurmctld.log"
    sleep 1
done
echo "$PARTITION"
