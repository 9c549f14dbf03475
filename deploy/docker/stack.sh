#!/usr/bin/env bash
# The compose stack from a fresh machine: a container engine, images built with no registry, and
# docker-compose (or `docker compose`) around deploy's files.
#
#   deploy/docker/stack.sh engine   # print `export DOCKER_HOST=...`, starting dockerd if none answers
#   deploy/docker/stack.sh images   # base, Valkey and Prometheus images from Debian packages, wheelhouse, rlmesh:cpu
#   deploy/docker/stack.sh up       # images, then `compose up -d`, then where the outputs are
#                                   # (`up --profile observability`: Prometheus too, on 127.0.0.1:9090)
#   deploy/docker/stack.sh down     # stop and remove containers, networks and volumes
#   deploy/docker/stack.sh logs|ps [compose args]   # the stack's logs (`logs -f learner`) or containers
#   deploy/docker/stack.sh copy-run DIR             # copy the run's outputs out of the learner's volume
#   deploy/docker/stack.sh follow-up                # print the commands above for this stack (`up` does)
#
# Environment: RLMESH_DOCKER_DIR (where a dockerd started here keeps its state, default
# /tmp/rlmesh-docker), PYTHON (the pip that builds the wheelhouse, default .venv/bin/python),
# RLMESH_WHEELS_PORT (where the build reads the wheelhouse, on the engine's bridge; default 38771),
# COMPOSE_PROJECT_NAME (default rlmesh), and any compose variable (RLMESH_TOKEN, RLMESH_IMAGE...).
# The compose file requires RLMESH_TOKEN and RLMESH_QUEUE_PASSWORD: when unset, `up` makes random
# ones (kept only in the containers' environment; `down` needs none).
set -euo pipefail
cd "$(dirname "$0")/../.."
random_secret() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
export RLMESH_TOKEN=${RLMESH_TOKEN:-$(random_secret)}
export RLMESH_QUEUE_PASSWORD=${RLMESH_QUEUE_PASSWORD:-$(random_secret)}

ENGINE_DIR=${RLMESH_DOCKER_DIR:-/tmp/rlmesh-docker}
PYTHON=${PYTHON:-.venv/bin/python}
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-rlmesh}
BASE_IMAGE=rlmesh/base:bookworm
VALKEY_IMAGE=rlmesh/valkey:bookworm
PROMETHEUS_IMAGE=rlmesh/prometheus:bookworm
# Debian's client when there is one: the newer client some images ship lacks the buildx plugin.
DOCKER=docker
[ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker

say() { echo "stack: $*" >&2; }
# shellcheck source=deploy/docker/build_replacing.sh
. deploy/docker/build_replacing.sh

need_root() {
  [ "$(id -u)" = 0 ] || { say "$1 needs root (or install it yourself: $2)"; exit 1; }
}

engine() {
  if [ -n "${DOCKER_HOST:-}" ] && $DOCKER info >/dev/null 2>&1; then
    echo "export DOCKER_HOST=$DOCKER_HOST"; return
  fi
  if [ -z "${DOCKER_HOST:-}" ] && $DOCKER info >/dev/null 2>&1; then
    return  # the machine's own engine answers on its default socket
  fi
  export DOCKER_HOST="unix://$ENGINE_DIR/docker.sock"
  if ! $DOCKER info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v mmdebstrap >/dev/null; then
      need_root "installing docker.io, docker-compose and mmdebstrap" "apt-get install docker.io docker-compose mmdebstrap"
      say "installing the container engine from Debian's packages"
      apt-get update -qq >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose mmdebstrap >&2
    fi
    need_root "starting dockerd" "start dockerd and set DOCKER_HOST"
    mkdir -p "$ENGINE_DIR"
    say "starting dockerd (state in $ENGINE_DIR, log $ENGINE_DIR/dockerd.log)"
    # No systemd here: the daemon runs in the background with its own root, exec root and socket.
    setsid dockerd --data-root "$ENGINE_DIR/data" --exec-root "$ENGINE_DIR/exec" \
      -H "$DOCKER_HOST" --pidfile "$ENGINE_DIR/dockerd.pid" >"$ENGINE_DIR/dockerd.log" 2>&1 < /dev/null &
    for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 1; done
    $DOCKER info >/dev/null 2>&1 || { say "dockerd did not answer in 60 s; see $ENGINE_DIR/dockerd.log"; exit 1; }
  fi
  echo "export DOCKER_HOST=$DOCKER_HOST"
}

has_image() { $DOCKER image inspect "$1" >/dev/null 2>&1; }

# A Debian rootfs from Debian's packages, imported as an image: no registry needed.
debian_image() {
  local tag=$1 include=$2; shift 2
  say "building $tag from Debian packages ($include)"
  mmdebstrap --quiet --variant=minbase --include="$include" "$@" bookworm - \
    | $DOCKER import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$tag" >/dev/null
}

# A build whose dependency layer is not cached writes ~5 GB (the virtualenv's layer, with pip's
# temporary files beside it); with less free, it fails half-way with pip's "No space left on device".
check_space() {
  local root free_gb
  root=$($DOCKER info -f '{{.DockerRootDir}}' 2>/dev/null || true)
  [ -d "$root" ] || return 0  # a remote engine: its disk is not ours to measure
  free_gb=$(( $(df -Pk "$root" | awk 'NR==2 {print $4}') / 1048576 ))
  if [ "$free_gb" -lt 8 ]; then
    say "warning: $free_gb GB free under $root; an uncached build needs ~8 GB. Free some with" \
        "'docker image prune' (untagged images) or 'docker rmi' of old rlmesh images"
  fi
}

images() {
  check_space
  # The Valkey and Prometheus images build beside the rest (mmdebstrap mostly downloads and unpacks);
  # the base image is needed first, by the rlmesh build.
  local pids=()
  # Redis from Debian under Valkey's command names, so the compose file's commands work with both
  # this image and valkey/valkey. Valkey is a fork of Redis 7.2 and speaks the same protocol.
  has_image "$VALKEY_IMAGE" || { debian_image "$VALKEY_IMAGE" redis-server,redis-tools \
    --customize-hook='ln -s /usr/bin/redis-server "$1/usr/local/bin/valkey-server"' \
    --customize-hook='ln -s /usr/bin/redis-cli "$1/usr/local/bin/valkey-cli"' \
    --customize-hook='mkdir -p "$1/data"' --customize-hook='chown 999:999 "$1/data"' & pids+=($!); }
  # Debian's Prometheus server for the compose file's `observability` profile. It runs as nobody
  # (65534, as prom/prometheus does), whose /prometheus a fresh named volume copies, owner included.
  has_image "$PROMETHEUS_IMAGE" || { debian_image "$PROMETHEUS_IMAGE" prometheus \
    --customize-hook='mkdir -p "$1/prometheus"' --customize-hook='chown 65534:65534 "$1/prometheus"' & pids+=($!); }
  # The wheelhouse downloads beside the base image (neither needs the other; the build needs both).
  say "wheelhouse: pip download of rlmesh's locked requirements into deploy/docker/wheelhouse"
  local log="${TMPDIR:-/tmp}/rlmesh-wheelhouse.log"  # not in the build context: it would bust the cache
  # Debian's Python is 3.11.2: redis wants async-timeout below 3.11.3; pip here resolves for the host's.
  PYTHONWARNINGS=ignore "$PYTHON" -m pip download -q --disable-pip-version-check -d deploy/docker/wheelhouse \
    ".[train,cpu,envs]" "setuptools>=69" wheel "async-timeout>=4.0.3" >"$log" 2>&1 &
  local wheels_pid=$!
  has_image "$BASE_IMAGE" || debian_image "$BASE_IMAGE" python3,python3-venv,python3-dev,libgomp1,libnuma1,g++,ca-certificates
  if ! wait "$wheels_pid"; then
    cat "$log" >&2; say "pip download failed (log above, also in $log)"; exit 1
  fi
  local image=${RLMESH_IMAGE:-rlmesh:cpu}
  say "building $image (offline: base $BASE_IMAGE, wheels served from the wheelhouse)"
  serve_wheels
  build_replacing "$image" -f deploy/docker/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg WHEELS_URL="$WHEELS_URL" --build-arg WHEELS_DIGEST="$(wheels_digest)" .
  stop_wheels
  for pid in "${pids[@]}"; do
    wait "$pid" || { say "building the Valkey or Prometheus image failed (its mmdebstrap output is above)"; exit 1; }
  done
  # Until 2026-11-27 the image was built in two stages, the first tagged <image>-build (~5.5 GB).
  if has_image "$image-build" && $DOCKER rmi "$image-build" >/dev/null 2>&1; then
    say "removed $image-build, the build stage older versions of this script kept"
  fi
}

# The wheelhouse over HTTP on the engine's bridge gateway, for the build's RUN steps (the classic
# builder cannot mount a host directory; a COPY would put ~1 GB of wheels in a layer that a second
# stage then had to leave out by copying the ~4 GB virtualenv). It listens only on that interface, for
# the build's length, and answers only GET/HEAD of the index and of the package files in it
# (serve_wheels.py). A fixed port keeps the build's cache keys stable (the URL is a build argument);
# RLMESH_WHEELS_PORT picks another.
serve_wheels() {
  local gateway port=${RLMESH_WHEELS_PORT:-38771}
  gateway=$(bridge_gateway)
  if [ -z "$gateway" ]; then
    say "the engine has no bridge network to serve the wheelhouse on; build the image with a registry and"
    say "PyPI instead (deploy/docker/Dockerfile says how)"; exit 1
  fi
  "$PYTHON" deploy/docker/serve_wheels.py deploy/docker/wheelhouse "$gateway" "$port" \
    >"${TMPDIR:-/tmp}/rlmesh-wheels-http.log" 2>&1 &
  WHEELS_PID=$!
  trap stop_wheels EXIT
  WHEELS_URL="http://$gateway:$port/"
  local tries=0
  until "$PYTHON" -c "import urllib.request as u; u.urlopen('$WHEELS_URL', timeout=2)" 2>/dev/null; do
    if ! kill -0 "$WHEELS_PID" 2>/dev/null || [ $((tries += 1)) -gt 50 ]; then
      cat "${TMPDIR:-/tmp}/rlmesh-wheels-http.log" >&2
      say "could not serve the wheelhouse on $WHEELS_URL: port in use (set RLMESH_WHEELS_PORT), or the gateway"
      say "is not an address of this machine (a remote engine: build there, with a registry and PyPI)"; exit 1
    fi
    sleep 0.2
  done
}

# The host's address on the engine's default bridge. Newer engines report it as the IPAM gateway; Debian
# 12's docker.io (20.10) leaves that empty ([{"Subnet":"172.17.0.0/16"}]) and the address is only on
# the bridge's interface (docker0); failing that, the subnet's first host address, which dockerd takes.
bridge_gateway() {
  local gw ifname subnet
  gw=$($DOCKER network inspect bridge -f '{{range .IPAM.Config}}{{.Gateway}}{{end}}' 2>/dev/null || true)
  if [ -z "$gw" ]; then
    ifname=$($DOCKER network inspect bridge -f '{{index .Options "com.docker.network.bridge.name"}}' 2>/dev/null || true)
    gw=$(ip -4 -o addr show dev "${ifname:-docker0}" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
  fi
  if [ -z "$gw" ]; then
    subnet=$($DOCKER network inspect bridge -f '{{range .IPAM.Config}}{{.Subnet}}{{end}}' 2>/dev/null || true)
    [ -n "$subnet" ] && gw=$("$PYTHON" -c 'import ipaddress, sys; print(next(ipaddress.ip_network(sys.argv[1]).hosts()))' \
      "$subnet" 2>/dev/null)
  fi
  echo "$gw"
}

stop_wheels() {
  if [ -n "${WHEELS_PID:-}" ]; then kill "$WHEELS_PID" 2>/dev/null || true; wait "$WHEELS_PID" 2>/dev/null || true; fi
  WHEELS_PID=
}

# The wheel set's name: a different set of files gets a different digest, and a fresh dependency layer.
wheels_digest() {
  (cd deploy/docker/wheelhouse && ls -1 | sort | sha256sum | cut -c1-16)
}

compose() {
  if command -v docker-compose >/dev/null; then docker-compose "$@"; else $DOCKER compose "$@"; fi
}

up() {
  export RLMESH_VALKEY_IMAGE=${RLMESH_VALKEY_IMAGE:-$VALKEY_IMAGE}
  export RLMESH_PROMETHEUS_IMAGE=${RLMESH_PROMETHEUS_IMAGE:-$PROMETHEUS_IMAGE}
  # compose 1.29 takes --profile before the command, v2 either side: `up --profile observability`
  # here becomes `--profile observability up`.
  local profiles=()
  while [ "${1:-}" = --profile ]; do profiles+=(--profile "$2"); shift 2; done
  compose "${profiles[@]}" up -d --no-build "$@"
  follow_up >&2
}

# What `up` prints: commands that work exactly as printed, from the repository root, in any shell (this
# script finds the engine and the project name; a project named other than rlmesh is written in).
follow_up() {
  local env=""
  [ "$COMPOSE_PROJECT_NAME" != rlmesh ] && env="COMPOSE_PROJECT_NAME=$COMPOSE_PROJECT_NAME "
  cat <<EOF
stack: up. Follow it with:
  ${env}deploy/docker/stack.sh logs -f learner          # or: ${env}deploy/docker/stack.sh ps
stack: the run's outputs (metrics.jsonl, summary.json, reward_curve.png, checkpoints) are in the
  volume ${COMPOSE_PROJECT_NAME}_rlmesh-data under runs/compose; copy them out with
  ${env}deploy/docker/stack.sh copy-run ./compose-run
EOF
}

copy_run() {
  local dest=${1:?usage: stack.sh copy-run DIR}
  local learner
  learner=$(compose ps -q learner)
  [ -n "$learner" ] || { echo "stack: no learner container in project $COMPOSE_PROJECT_NAME (is the stack up?)" >&2; exit 1; }
  $DOCKER cp "$learner:/data/runs/compose" "$dest"
  echo "stack: the run's outputs are in $dest" >&2
}

cmd=${1:-}
shift || true
case "$cmd" in
  engine) engine ;;
  images) eval "$(engine)"; images ;;
  up) eval "$(engine)"; images; up "$@" ;;
  # Every profile, so that an `observability` stack's Prometheus goes too.
  down) eval "$(engine)"; RLMESH_VALKEY_IMAGE=${RLMESH_VALKEY_IMAGE:-$VALKEY_IMAGE} \
    RLMESH_PROMETHEUS_IMAGE=${RLMESH_PROMETHEUS_IMAGE:-$PROMETHEUS_IMAGE} \
    compose --profile observability down -v --remove-orphans "$@" ;;
  # Follow-ups: the secrets above are made up when unset, which logs and ps never use.
  logs|ps) eval "$(engine)"; RLMESH_VALKEY_IMAGE=${RLMESH_VALKEY_IMAGE:-$VALKEY_IMAGE} \
    RLMESH_PROMETHEUS_IMAGE=${RLMESH_PROMETHEUS_IMAGE:-$PROMETHEUS_IMAGE} compose "$cmd" "$@" ;;
  copy-run) eval "$(engine)"; RLMESH_VALKEY_IMAGE=${RLMESH_VALKEY_IMAGE:-$VALKEY_IMAGE} \
    RLMESH_PROMETHEUS_IMAGE=${RLMESH_PROMETHEUS_IMAGE:-$PROMETHEUS_IMAGE} copy_run "$@" ;;
  follow-up) follow_up ;;
  *) echo "usage: $0 engine|images|up|down|logs|ps|copy-run|follow-up [args]" >&2; exit 2 ;;
esac
