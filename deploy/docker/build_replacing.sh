# Sourced by stack.sh and the Slurm test cluster's cluster.sh (which define DOCKER and say).
#
# build_replacing TAG [docker build args...]: `docker build -q -t TAG args...`, then the image TAG named
# before is removed. A rebuild moves the tag and would leave the previous image (~4.5 GB) untagged on
# disk, so that rebuilding after each change filled the disk (CI ran out of it). An image a container
# still uses is kept (rmi refuses).
#
# RLMESH_BUILD_CPU_SHARES=N runs the build's steps with `--cpu-shares N`: their containers' cgroup then
# yields the CPU to everything else on the machine (2, the least, is what .ci/run uses to build the
# images beside `make setup`). Niceness alone would not: the steps run in cgroups of their own.
build_replacing() {
  local tag=$1 before after; shift
  before=$($DOCKER image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
  local shares=()
  [ -n "${RLMESH_BUILD_CPU_SHARES:-}" ] && shares=(--cpu-shares "$RLMESH_BUILD_CPU_SHARES")
  DOCKER_BUILDKIT=0 $DOCKER build -q "${shares[@]}" -t "$tag" "$@" >&2
  after=$($DOCKER image inspect -f '{{.Id}}' "$tag")
  if [ -n "$before" ] && [ "$before" != "$after" ] && $DOCKER rmi "$before" >/dev/null 2>&1; then
    say "removed the previous $tag (${before:7:12})"
  fi
}
