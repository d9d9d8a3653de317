#!/usr/bin/env bash
# A real SLURM cluster on this machine, for the SLURM tests (and by hand:
# `sudo tests/slurm/start_cluster.sh`). Idempotent: installs Debian's slurm-wlm and munge
# if missing, writes /etc/slurm/slurm.conf if it differs, starts munged, slurmctld and the
# slurmds if they are not running, and waits until the nodes are idle. Prints the partition name.
#
# Two nodes. This host is the first, and the partition every test submits to by default holds
# it alone. The second, `eagleflow-n2`, is a slurmd in a network namespace and a UTS namespace
# of its own (ip netns, unshare): its own hostname, its own loopback and one address,
# 10.77.0.2, on a veth pair whose other end, 10.77.0.1, is the first node's address in the
# cluster. A server the second node binds is reachable only at that address, as on another
# machine; the filesystem and munge's socket are shared, as a cluster's shared filesystem
# would be. The partition `<partition>-two` holds both (tests/integration/test_served_slurm.py:
# the trainer on one node, vLLM on the other). Where network namespaces cannot be made,
# the cluster is the first node alone and says so on stderr.
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
    || ! command -v munged >/dev/null || ! command -v ip >/dev/null || ! command -v nsenter >/dev/null; then
    echo "start_cluster: installing slurm-wlm, munge, iproute2 and util-linux" >&2
    export DEBIAN_FRONTEND=noninteractive
    PACKAGES="slurm-wlm munge iproute2 util-linux"
    apt-get install -y -q --no-install-recommends $PACKAGES >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends $PACKAGES >&2; } \
        || die "apt-get could not install $PACKAGES"
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
NODE2=eagleflow-n2
NETNS=eagleflow-n2
HOST_ADDR=10.77.0.1
NODE2_ADDR=10.77.0.2

# The second node's network: a namespace with loopback and one end of a veth pair, its
# default route the first node. Idempotent.
second_node_network() {
    if ! ip netns list 2>/dev/null | grep -qw "$NETNS"; then
        ip netns add "$NETNS" || return 1
    fi
    if ! ip link show eagleflow-n1 >/dev/null 2>&1; then
        ip link add eagleflow-n1 type veth peer name eagleflow-n2 || return 1
        ip link set eagleflow-n2 netns "$NETNS" || return 1
    fi
    ip addr show eagleflow-n1 | grep -q "inet $HOST_ADDR/" || ip addr add "$HOST_ADDR/24" dev eagleflow-n1 || return 1
    ip link set eagleflow-n1 up || return 1
    ip netns exec "$NETNS" sh -c "
        ip link set lo up &&
        { ip addr show eagleflow-n2 | grep -q 'inet $NODE2_ADDR/' || ip addr add $NODE2_ADDR/24 dev eagleflow-n2; } &&
        ip link set eagleflow-n2 up &&
        { ip route show default | grep -q . || ip route add default via $HOST_ADDR; }" || return 1
}
# Idempotent, so tried again: a step can fail while the veth's carrier comes up (a default
# route via a gateway not yet reachable), and CI's first start on a fresh machine once came up
# one node where a second start on the same machine came up two.
two_nodes_made=0
for attempt in 1 2 3 4 5; do
    if second_node_network; then
        two_nodes_made=1
        break
    fi
    echo "start_cluster: the second node's network, attempt $attempt failed" >&2
    sleep 1
done
if [ "$two_nodes_made" = 1 ]; then
    TWO_NODES=1
    # Its hostname resolves (torchrun's rendezvous looks its own host up), as a cluster's do.
    grep -qE "^$NODE2_ADDR[[:space:]]+$NODE2\$" /etc/hosts 2>/dev/null \
        || echo "$NODE2_ADDR $NODE2" >>/etc/hosts \
        || echo "start_cluster: could not add $NODE2 to /etc/hosts" >&2
else
    echo "start_cluster: no network namespace here: the cluster is one node, without $NODE2" >&2
    TWO_NODES=0
    HOST_ADDR=127.0.0.1
fi
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

mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd-$HOST" "$STATE/slurmd-$NODE2" "$LOGS"
NEW_CONF="$(cat <<CONF
# Written by eagleflow tests/slurm/start_cluster.sh: no accounting, for tests.
ClusterName=eagleflow
SlurmctldHost=$HOST($HOST_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
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
NodeName=$HOST NodeAddr=$HOST_ADDR CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
)"
if [ "$TWO_NODES" = 1 ]; then
    NEW_CONF="$NEW_CONF
NodeName=$NODE2 NodeAddr=$NODE2_ADDR CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION-two Nodes=$HOST,$NODE2 MaxTime=INFINITE State=UP"
fi

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

CGROUP_FILE="$CONF_DIR/cgroup.conf"
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW_CONF" ] || [ "$(cat "$CGROUP_FILE" 2>/dev/null)" != "$CGROUP_CONF" ]; then
    printf '%s\n' "$NEW_CONF" >"$CONF"
    if [ -n "$CGROUP_CONF" ]; then printf '%s\n' "$CGROUP_CONF" >"$CGROUP_FILE"; else rm -f "$CGROUP_FILE"; fi
    # A changed config needs restarted daemons; stop the ones this script started before.
    for pidfile in /run/slurmd.pid /run/slurmd-$HOST.pid /run/slurmd-$NODE2.pid /run/slurmctld.pid; do
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
running "/run/slurmd-$HOST.pid" || slurmd
if [ "$TWO_NODES" = 1 ] && ! running "/run/slurmd-$NODE2.pid"; then
    # Its own network and hostname; slurmd finds its NodeName by the hostname. nsenter, not
    # `ip netns exec`, which mounts a /sys of the namespace's own without the cgroup mounts.
    nsenter --net="/run/netns/$NETNS" unshare --uts sh -c "hostname $NODE2 && exec slurmd"
fi

NODES="$HOST"
[ "$TWO_NODES" = 1 ] && NODES="$HOST $NODE2"
deadline=$((SECONDS + WAIT_S))
for node in $NODES; do
    while :; do
        state="$(sinfo -h -N -n "$node" -o %T 2>/dev/null | head -1)"
        case "$state" in
            idle | mixed | allocated) break ;;
            down* | drain* | drained*)
                # Left over from an earlier start (e.g. a node that was not responding).
                scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
        [ "$SECONDS" -lt "$deadline" ] \
            || die "node $node is '$state' after ${WAIT_S}s; see $LOGS/slurmd-$node.log and $LOGS/slurmctld.log"
        sleep 1
    done
done
echo "$PARTITION"
