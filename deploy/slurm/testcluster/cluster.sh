#!/usr/bin/env bash
# rlmesh's Slurm test cluster in a Docker engine, built with no registry: Debian's Slurm 22.05 on top
# of the rlmesh image (deploy/docker/stack.sh images builds that).
#
#   deploy/slurm/testcluster/cluster.sh image   # download Slurm's .debs on the host, build rlmesh/slurm:test
#   deploy/slurm/testcluster/cluster.sh up      # image, then the controller and node1..node4; waits for 4 idle nodes
#   deploy/slurm/testcluster/cluster.sh run CMD...   # CMD on the controller as the rlmesh user (sbatch, squeue...)
#   deploy/slurm/testcluster/cluster.sh down    # containers, network and volumes gone
#
# Environment: COMPOSE_PROJECT_NAME (default rlmesh-slurm), RLMESH_IMAGE (default rlmesh:cpu),
# RLMESH_SLURM_IMAGE (default rlmesh/slurm:test), and the engine as for stack.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-rlmesh-slurm}
export RLMESH_SLURM_IMAGE=${RLMESH_SLURM_IMAGE:-rlmesh/slurm:test}
RLMESH_IMAGE=${RLMESH_IMAGE:-rlmesh:cpu}
DOCKER=docker
[ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker
PACKAGES=(munge slurmctld slurmd slurm-client procps)

say() { echo "cluster: $*" >&2; }
# shellcheck source=deploy/docker/build_replacing.sh
. "$REPO/deploy/docker/build_replacing.sh"
eval "$("$REPO/deploy/docker/stack.sh" engine)"

compose() {
  if command -v docker-compose >/dev/null; then docker-compose -f "$HERE/compose.yaml" "$@"
  else $DOCKER compose -f "$HERE/compose.yaml" "$@"; fi
}

image() {
  $DOCKER image inspect "$RLMESH_IMAGE" >/dev/null 2>&1 \
    || { say "no $RLMESH_IMAGE image: build it first (make images)"; exit 1; }
  # The packages the base image lacks, resolved against its own package list by the host's apt.
  local work; work=$(mktemp -d)
  $DOCKER run --rm --entrypoint cat "$RLMESH_IMAGE" /var/lib/dpkg/status >"$work/status"
  rm -rf "$HERE/debs" && mkdir -p "$HERE/debs/partial"
  say "downloading ${PACKAGES[*]} and their dependencies (Debian's packages, on the host)"
  local get=(apt-get -qq -o Dir::State::status="$work/status" -o Dir::Cache::archives="$HERE/debs"
             -o Debug::NoLocking=1 install --download-only -y --no-install-recommends "${PACKAGES[@]}")
  # A fresh machine may have no package lists yet (or stale ones): update them once and retry.
  "${get[@]}" >&2 2>/dev/null || { apt-get update -qq >&2 && "${get[@]}" >&2; }
  rm -rf "$HERE/debs/partial" "$HERE/debs/lock" "$work"
  say "building $RLMESH_SLURM_IMAGE from $RLMESH_IMAGE"
  # The previous node image goes (and with it a previous rlmesh image it was built on).
  build_replacing "$RLMESH_SLURM_IMAGE" --build-arg RLMESH_IMAGE="$RLMESH_IMAGE" "$HERE"
}

up() {
  image
  compose up -d >&2
  say "waiting for the four compute nodes to be idle"
  for _ in $(seq 90); do
    if [ "$(run sinfo -h -o '%T %D' 2>/dev/null | awk '$1=="idle"{n+=$2} END{print n+0}')" = 4 ]; then
      run sinfo >&2; return
    fi
    sleep 1
  done
  run sinfo >&2 || true
  say "the nodes did not become idle in 90 s; slurmctld's log:"; compose exec -T slurmctld tail -30 /var/log/slurm/slurmctld.log >&2
  exit 1
}

run() { compose exec -T -u 10001 -w /shared slurmctld "$@"; }

down() { compose down -v --remove-orphans >&2; }

cmd=${1:-}
shift || true
case "$cmd" in
  image) image ;;
  up) up ;;
  run) run "$@" ;;
  down) down ;;
  *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
