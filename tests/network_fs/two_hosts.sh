#!/usr/bin/env bash
# A network filesystem on loopback, seen by two "hosts": one export, mounted twice over SFTP
# (sshfs, a FUSE filesystem that /proc/mounts names fuse.sshfs), for
# tests/integration/test_network_store.py. Each mount is its own client of the export, as two
# cluster nodes are of an NFS share: a lock one takes is invisible to the other. This
# machine's kernel has no NFS client; FUSE it has.
#
#   tests/network_fs/two_hosts.sh up DIR     # DIR/export, mounted at DIR/host-a and DIR/host-b
#   tests/network_fs/two_hosts.sh down DIR
#
# Run as root: installs Debian's sshfs and openssh-server if missing, starts a private sshd on
# 127.0.0.1 with throwaway keys under DIR. Caches are off (entries, attributes, directories),
# as an NFS client revalidates what it opens: otherwise a file one mount removed would still
# be there for the other for 20 s.
set -euo pipefail

die() { echo "two_hosts: $*" >&2; exit 1; }

ACTION="${1:-}"
DIR="${2:-}"
[ -n "$ACTION" ] && [ -n "$DIR" ] || die "usage: $0 up|down DIR"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
ETC="$DIR/etc"

if [ "$ACTION" = down ]; then
    for host in host-a host-b; do
        mountpoint -q "$DIR/$host" && fusermount -u "$DIR/$host"
    done
    [ -s "$ETC/sshd.pid" ] && kill "$(cat "$ETC/sshd.pid")" 2>/dev/null || true
    exit 0
fi
[ "$ACTION" = up ] || die "unknown action $ACTION (up or down)"

[ "$(id -u)" -eq 0 ] || die "must run as root (installs packages, starts sshd, mounts FUSE)"
[ -c /dev/fuse ] || die "no /dev/fuse: this machine cannot mount a FUSE filesystem"
if ! command -v sshfs >/dev/null || [ ! -x /usr/sbin/sshd ]; then
    echo "two_hosts: installing sshfs and openssh-server" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends sshfs openssh-server >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends sshfs openssh-server >&2; } \
        || die "apt-get could not install sshfs and openssh-server"
fi

mkdir -p "$DIR/export" "$DIR/host-a" "$DIR/host-b" "$ETC" /run/sshd
for key in host client; do
    [ -s "$ETC/$key" ] || ssh-keygen -q -t ed25519 -N "" -f "$ETC/$key"
done
cp "$ETC/client.pub" "$ETC/authorized_keys"
chmod 600 "$ETC/authorized_keys"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cat >"$ETC/sshd_config" <<EOF
Port $PORT
ListenAddress 127.0.0.1
HostKey $ETC/host
AuthorizedKeysFile $ETC/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
PidFile $ETC/sshd.pid
EOF
/usr/sbin/sshd -f "$ETC/sshd_config" -E "$ETC/sshd.log"

OPTIONS="IdentityFile=$ETC/client,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null"
OPTIONS="$OPTIONS,dir_cache=no,entry_timeout=0,attr_timeout=0,negative_timeout=0"
for host in host-a host-b; do
    for _ in $(seq 50); do
        sshfs -p "$PORT" -o "$OPTIONS" "root@127.0.0.1:$DIR/export" "$DIR/$host" 2>>"$ETC/sshfs.log" && break
        sleep 0.2
    done
    mountpoint -q "$DIR/$host" || die "sshfs could not mount $DIR/$host: $(tail -3 "$ETC/sshfs.log")"
done
echo "$DIR"
