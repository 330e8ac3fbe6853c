#!/usr/bin/env bash
# Build Banyan's CPU container images on a bare Debian bookworm host that reaches Debian's apt and
# PyPI but not Docker Hub (CI, developer machines). Idempotent — each step is skipped when done:
#
#   1. install Debian's Docker engine, docker-compose 1.29 and debootstrap   (if dockerd is missing)
#   2. start dockerd in the background, log in $STATE/dockerd.log          (if no daemon answers)
#   3. build the base image banyan-base:bookworm from debootstrap minbase  (if the image is missing)
#   4. build banyan:cpu (Dockerfile) and banyan-proxy (deploy/proxy/Dockerfile), layer-cached
#
#   bash scripts/docker_ci.sh            # all four steps
#   bash scripts/docker_ci.sh engine     # steps 1-2 only
#
# The CPU torch wheel (torch 2.13.0+cpu) is taken from this host's pip find-links (or the pip cache)
# and copied into docker/wheels/ (git- but not docker-ignored) so the image never pulls the
# multi-GB CUDA build from PyPI; the host's CA bundle goes into the build as a BuildKit secret.
# Exit status 0 only when the images exist; any failure says which step and why.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${BANYAN_DOCKER_STATE:-/var/tmp/banyan-docker}"
BASE_IMAGE="${BANYAN_BASE_IMAGE:-banyan-base:bookworm}"
MIRROR="${BANYAN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_VERSION=2.13.0
# Debian's CLI matches Debian's daemon (20.10); a newer docker CLI earlier in PATH wants buildx.
DOCKER=/usr/bin/docker
export DOCKER_BUILDKIT=1

log() { printf '[docker_ci %(%T)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
CLEANUP=()
trap 'rm -rf "${CLEANUP[@]}"' EXIT

install_engine() {
  local missing=()
  [[ -x /usr/sbin/dockerd && -x $DOCKER ]] || missing+=(docker.io containerd runc)
  command -v iptables >/dev/null || missing+=(iptables)
  [[ -x /usr/bin/docker-compose ]] || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]} from Debian"
  [[ $(id -u) == 0 ]] || die "installing the Docker engine needs root (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # Daemons are started below, not by the packages' maintainer scripts.
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    CLEANUP+=(/usr/sbin/policy-rc.d)
  fi
  mkdir -p "$STATE"
  local apt=(apt-get -q -o DPkg::Lock::Timeout=600)   # wait for another apt/dpkg, don't fail
  { "${apt[@]}" update && "${apt[@]}" install -y --no-install-recommends docker.io containerd runc \
      iptables docker-compose debootstrap ca-certificates; } >"$STATE/apt.log" 2>&1 \
    || { tail -n 30 "$STATE/apt.log" >&2; die "apt-get install of the Docker engine failed (log: $STATE/apt.log)"; }
}

start_daemon() {
  if "$DOCKER" info >/dev/null 2>&1; then return 0; fi
  mkdir -p "$STATE"
  log "starting dockerd (log: $STATE/dockerd.log)"
  # setsid + redirected fds: the daemon outlives this script without holding the caller's pipes.
  setsid dockerd >"$STATE/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 120); do
    "$DOCKER" info >/dev/null 2>&1 && return 0
    kill -0 $! 2>/dev/null || break
    sleep 0.5
  done
  tail -n 30 "$STATE/dockerd.log" >&2 || true
  die "dockerd did not come up (log above: $STATE/dockerd.log)"
}

build_base() {
  if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return 0; fi
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

# The CPU torch wheel: already in the context, else from pip's find-links (config or
# PIP_FIND_LINKS), else pip's cache. None found: the Dockerfile falls back to the PyTorch CPU index.
stage_torch_wheel() {
  local dest="$ROOT/docker/wheels" name="torch-$TORCH_VERSION+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
  mkdir -p "$dest"
  [[ -f $dest/$name ]] && return 0
  local dirs=() d
  for d in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true) \
           "$(python3 -m pip cache dir 2>/dev/null || true)"; do
    d="${d#file://}"
    [[ -d $d ]] && dirs+=("$d")
  done
  local found=""
  ((${#dirs[@]})) && found="$(find "${dirs[@]}" -name "$name" -print -quit 2>/dev/null || true)"
  if [[ -z $found ]]; then
    log "no local $name: the image will download torch from the PyPI CPU index"
    return 0
  fi
  log "copying $found into the build context"
  cp "$found" "$dest/$name.tmp" && mv "$dest/$name.tmp" "$dest/$name"
}

build_images() {
  stage_torch_wheel
  local secret=() ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
  [[ -f $ca ]] && secret=(--secret "id=ca,src=$ca")
  local args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" "${secret[@]}")
  build banyan:cpu "$ROOT/Dockerfile" "$ROOT" "${args[@]}"
  build banyan-proxy "$ROOT/deploy/proxy/Dockerfile" "$ROOT/deploy/proxy" "${args[@]}"
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

install_engine
start_daemon
[[ ${1:-all} == engine ]] && exit 0
build_base
build_images
log "images ready: $("$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^banyan' | tr '\n' ' ')"
