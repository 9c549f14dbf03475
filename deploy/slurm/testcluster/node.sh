#!/bin/sh
# A test-cluster node: munged with the cluster's key, then slurmctld (`controller`) or slurmd
# (`compute`) in the foreground. The controller makes the key on the cluster volume the first time.
set -eu
role=${1:?usage: rlmesh-slurm-node controller|compute}
key=/cluster/munge.key
if [ "$role" = controller ] && [ ! -s "$key" ]; then
  umask 077; dd if=/dev/urandom of="$key.tmp" bs=1024 count=1 status=none; mv "$key.tmp" "$key"
fi
for _ in $(seq 60); do [ -s "$key" ] && break; sleep 1; done
install -o munge -g munge -m 0400 "$key" /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged --force
case "$role" in
  controller) exec /usr/sbin/slurmctld -D -i ;;
  compute) exec /usr/sbin/slurmd -D -N "$(hostname)" ;;
  *) echo "unknown role $role" >&2; exit 2 ;;
esac
