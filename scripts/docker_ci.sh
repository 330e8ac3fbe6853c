#!/usr/bin/env bash
# Build Banyan's CPU container images on a bare Debian bookworm host that reaches Debian's apt and
# PyPI but not Docker Hub (CI, developer machines). Idempotent — each step is skipped when done:
#
#   1. install Debian's Docker engine (docker.io, containerd, runc, iptables)  (if no dockerd is installed)
#      and docker-compose 1.29                                 (if neither `docker compose` nor docker-compose works)
#   2. start dockerd in the background, log in $STATE/dockerd.log, pid in $STATE/dockerd.pid
#                                                                           (if no daemon answers)
#   3. build the base image banyan-base:bookworm from debootstrap minbase  (if the image is missing;
#      debootstrap is installed from Debian then, if missing)
#   4. build banyan:cpu (Dockerfile) and banyan-proxy (deploy/proxy/Dockerfile), layer-cached
#
#   bash scripts/docker_ci.sh              # all four steps
#   bash scripts/docker_ci.sh engine       # steps 1-2 only
#   bash scripts/docker_ci.sh stop         # stop the dockerd that step 2 started (nothing else), unless
#                                          # containers are still running
#   bash scripts/docker_ci.sh compose-v2 DIR   # Debian's compose v2 CLI plugin into DIR/cli-plugins, for
#                                          # `DOCKER_CONFIG=DIR docker compose` (the tests; nothing installed)
#   bash scripts/docker_ci.sh compose-v1   # Debian's docker-compose 1.29, if missing (the tests run both)
#
# An engine that is already installed (Docker CE, docker.io) and running is used as it is.
# The CPU torch wheel (torch 2.13.0+cpu) comes from this host's pip configuration (find-links,
# local indexes) into docker/wheels/ (git- but not docker-ignored), so the image never pulls the
# multi-GB CUDA build from PyPI; the host's CA bundle goes into the build as a BuildKit secret.
# Exit status 0 only when the images exist; any failure says which step and why.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${BANYAN_DOCKER_STATE:-/var/tmp/banyan-docker}"
BASE_IMAGE="${BANYAN_BASE_IMAGE:-banyan-base:bookworm}"
MIRROR="${BANYAN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_VERSION=2.13.0
# Debian's (or Docker CE's) CLI in /usr/bin matches its daemon; a newer static docker CLI earlier in
# PATH may want buildx for DOCKER_BUILDKIT=1.
DOCKER=/usr/bin/docker
[[ -x $DOCKER ]] || DOCKER="$(command -v docker || echo /usr/bin/docker)"
export DOCKER_BUILDKIT=1
export PATH="$PATH:/usr/sbin:/sbin"   # dockerd, debootstrap, iptables, for a PATH without them

log() { printf '[docker_ci %(%T)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
mkdir -p "$STATE"
CLEANUP=()
trap 'rm -rf "${CLEANUP[@]}"' EXIT

apt_install() {   # apt_install PKG...: from Debian, as root, daemons not started by the packages
  log "installing $* from Debian"
  [[ $(id -u) == 0 ]] || die "installing $* needs root (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # Daemons are started below, not by the packages' maintainer scripts.
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    CLEANUP+=(/usr/sbin/policy-rc.d)
  fi
  local apt=(apt-get -q -o DPkg::Lock::Timeout=600)   # wait for another apt/dpkg, don't fail
  { "${apt[@]}" update && "${apt[@]}" install -y --no-install-recommends "$@"; } >"$STATE/apt.log" 2>&1 \
    || { tail -n 30 "$STATE/apt.log" >&2; die "apt-get install of $* failed (log: $STATE/apt.log)"; }
}

have_compose() { "$DOCKER" compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }

install_engine() {
  local missing=()
  if ! "$DOCKER" info >/dev/null 2>&1 && ! command -v dockerd >/dev/null && [[ ! -x /usr/sbin/dockerd ]]; then
    missing+=(docker.io containerd runc)
    command -v iptables >/dev/null || [[ -x /usr/sbin/iptables ]] || missing+=(iptables)
  fi
  have_compose || missing+=(docker-compose)
  # ca-certificates only when missing (never upgraded here): the image build's pip trusts this bundle
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] || missing+=(ca-certificates)
  ((${#missing[@]})) || return 0
  apt_install "${missing[@]}"
  [[ -x /usr/bin/docker ]] && DOCKER=/usr/bin/docker
}

start_daemon() {
  if "$DOCKER" info >/dev/null 2>&1; then return 0; fi
  log "starting dockerd (log: $STATE/dockerd.log; stop it with: bash scripts/docker_ci.sh stop)"
  # setsid + redirected fds: the daemon outlives this script without holding the caller's pipes.
  setsid "$(command -v dockerd || echo /usr/sbin/dockerd)" >"$STATE/dockerd.log" 2>&1 </dev/null &
  echo $! >"$STATE/dockerd.pid"   # the one `stop` may stop
  for _ in $(seq 120); do
    "$DOCKER" info >/dev/null 2>&1 && return 0
    kill -0 $! 2>/dev/null || break
    sleep 0.5
  done
  tail -n 30 "$STATE/dockerd.log" >&2 || true
  die "dockerd did not come up (log above: $STATE/dockerd.log)"
}

stop_daemon() {
  local pid
  pid="$(cat "$STATE/dockerd.pid" 2>/dev/null || true)"
  if [[ -z $pid ]] || ! kill -0 "$pid" 2>/dev/null || [[ $(cat "/proc/$pid/comm" 2>/dev/null) != dockerd ]]; then
    rm -f "$STATE/dockerd.pid"
    log "no dockerd started by this script is running: nothing to stop"
    return 0
  fi
  local running
  running="$("$DOCKER" ps -q 2>/dev/null | wc -l)"
  if ((running > 0)); then
    log "dockerd (pid $pid) left running: $running container(s) still run ($DOCKER ps)"
    return 0
  fi
  log "stopping dockerd (pid $pid)"
  kill -TERM "$pid"
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || { rm -f "$STATE/dockerd.pid"; return 0; }; sleep 0.5; done
  die "dockerd (pid $pid) did not stop within 30 s"
}

# compose-v2 DIR: Debian's docker-compose 2.x package (trixie; bookworm has only 1.29) downloaded with a
# private apt configuration — the system's sources, lists and packages are left as they are — and its
# CLI plugin unpacked into DIR/cli-plugins, so that `DOCKER_CONFIG=DIR docker compose` is compose v2.
compose_v2() {
  local dir=$1 apt="$STATE/apt-compose-v2"
  [[ -x $dir/cli-plugins/docker-compose ]] && return 0
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/deb" "$dir/cli-plugins"
  echo "deb ${MIRROR} trixie main" >"$apt/sources.list"
  local o=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
           -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
  log "downloading Debian trixie's docker-compose (v2) into $dir/cli-plugins (nothing is installed)"
  { apt-get -q "${o[@]}" update && (cd "$apt/deb" && apt-get -q "${o[@]}" download docker-compose); } \
    >"$STATE/apt-compose-v2.log" 2>&1 || { tail -n 20 "$STATE/apt-compose-v2.log" >&2; die "download of compose v2 failed"; }
  rm -rf "$apt/x" && dpkg-deb -x "$apt"/deb/docker-compose_2*.deb "$apt/x"
  local bin="$apt/x/usr/libexec/docker/cli-plugins/docker-compose"
  [[ -x $bin ]] || bin="$apt/x/usr/bin/docker-compose"
  install -m 755 "$bin" "$dir/cli-plugins/docker-compose"
}

build_base() {
  if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return 0; fi
  command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] || apt_install debootstrap
  log "building $BASE_IMAGE with debootstrap --variant=minbase bookworm ($MIRROR)"
  local dir
  dir="$(mktemp -d /var/tmp/banyan-rootfs.XXXXXX)"
  CLEANUP+=("$dir")
  debootstrap --variant=minbase bookworm "$dir" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -n 30 "$STATE/debootstrap.log" >&2; die "debootstrap failed"; }
  # What debian:bookworm-slim does: no docs/man/locales from later installs, no recommends,
  # apt lists and caches dropped after each install.
  cat >"$dir/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${MIRROR%/debian}/debian-security bookworm-security main
EOF
  cat >"$dir/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  cat >"$dir/etc/apt/apt.conf.d/docker" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
EOF
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/usr/share/doc/* \
    "$dir"/usr/share/man/* "$dir"/usr/share/locale/*
  tar -C "$dir" -c . | "$DOCKER" import -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null \
    || die "docker import of the rootfs failed"
}

# The CPU torch wheel for the image's Python (3.11): pip resolves `torch==2.13.0+cpu` through this
# host's own configuration (find-links, local indexes, cache). PyPI has no `+cpu` build, so this
# never downloads the multi-GB CUDA one; with no local copy the Dockerfile uses the PyTorch CPU index.
stage_torch_wheel() {
  local dest="$ROOT/docker/wheels"
  mkdir -p "$dest"
  compgen -G "$dest/torch-$TORCH_VERSION+cpu-cp311-*.whl" >/dev/null && return 0
  if python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.11 \
       --abi cp311 --platform manylinux_2_28_x86_64 -d "$dest" "torch==$TORCH_VERSION+cpu" >"$STATE/pip-download.log" 2>&1; then
    log "torch $TORCH_VERSION+cpu wheel staged in docker/wheels/"
  else
    log "no local torch $TORCH_VERSION+cpu wheel (see $STATE/pip-download.log): the image downloads it from the PyTorch CPU index"
  fi
}

build_images() {
  stage_torch_wheel
  local secret=() ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
  [[ -f $ca ]] && secret=(--secret "id=ca,src=$ca")
  local args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" "${secret[@]}")
  build banyan:cpu "$ROOT/Dockerfile" "$ROOT" "${args[@]}"
  build banyan-proxy "$ROOT/deploy/proxy/Dockerfile" "$ROOT/deploy/proxy" "${args[@]}"
  # Images that the new builds replaced (ours only: they carry this label).
  "$DOCKER" image prune -f --filter label=org.opencontainers.image.vendor=banyan >/dev/null || true
  "$DOCKER" builder prune -f --keep-storage 10GB >/dev/null || true   # bound the layer cache
}

# build TAG DOCKERFILE CONTEXT ARGS...: full output in $STATE/build-<name>.log, its tail on failure.
build() {
  local tag=$1 file=$2 ctx=$3 t0=$SECONDS
  shift 3
  local out="$STATE/build-${tag%%:*}.log"
  log "building $tag (log: $out)"
  if ! "$DOCKER" build --progress=plain "$@" -t "$tag" -f "$file" "$ctx" >"$out" 2>&1; then
    tail -n 40 "$out" >&2
    die "docker build of $tag failed (log above: $out)"
  fi
  log "built $tag in $((SECONDS - t0)) s"
}

case ${1:-all} in
  stop) stop_daemon; exit 0 ;;
  compose-v2) [[ -n ${2:-} ]] || die "usage: docker_ci.sh compose-v2 DIR"; compose_v2 "$2"; exit 0 ;;
  compose-v1) command -v docker-compose >/dev/null || apt_install docker-compose; exit 0 ;;
  engine | all) ;;
  *) die "unknown step ${1}: all | engine | stop | compose-v1 | compose-v2 DIR" ;;
esac
install_engine
start_daemon
[[ ${1:-all} == engine ]] && exit 0
build_base
build_images
log "images ready: $("$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^banyan' | tr '\n' ' ')"
