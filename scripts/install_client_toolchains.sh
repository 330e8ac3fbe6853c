#!/usr/bin/env bash
# Installs what clients/go and clients/java need to build OFFLINE, from Debian bookworm's own
# packages (no Go module proxy, no Maven Central), plus the buf CLI from the npm registry for
# `buf lint`. Idempotent: apt-get runs only when a package is missing, npm only when this buf
# version is not in the cache yet. Needs root (or sudo) for apt-get.
#
#   scripts/install_client_toolchains.sh      → prints "bin: DIR", then "buf: /path/to/buf" last
#
# BANYAN_TOOLS_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/banyan-tools) holds buf, and its bin/
# folder what `buf generate` (buf.gen.yaml) runs besides Debian's plugins: `buf` itself and
# `protoc-gen-grpc-java` (Debian installs it as /usr/bin/grpc_java_plugin). Put that folder on PATH:
#   export PATH="$HOME/.cache/banyan-tools/bin:$PATH" && buf generate
set -euo pipefail

BUF_VERSION=1.75.0

# Go: compiler, protoc plugins, and the library sources GOPATH mode builds against
# (/usr/share/gocode). golang-github-golang-protobuf-1-5-dev is named explicitly: grpc-dev accepts
# 1-3 too, whose proto.Marshal predates the APIv2 messages protoc-gen-go writes.
GO_PKGS=(golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev
         golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev)
# Java: the gRPC Java protoc plugin (/usr/bin/grpc_java_plugin) and the jars in
# /usr/share/java that clients/java/build.sh puts on the classpath.
JAVA_PKGS=(protobuf-compiler-grpc-java-plugin libgrpc-java libprotobuf-java
           libnetty-java libguava-java libperfmark-java libgoogle-gson-java
           libgeronimo-annotation-1.3-spec-java liberror-prone-java)

missing=()
for p in "${GO_PKGS[@]}" "${JAVA_PKGS[@]}"; do
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done
# Any JDK >= 17 and any npm will do (the machine's own, or Debian's).
command -v javac >/dev/null || missing+=(default-jdk-headless)
command -v npm >/dev/null || missing+=(npm)

if [ ${#missing[@]} -gt 0 ]; then
  echo "installing from apt: ${missing[*]}"
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "not root and no sudo: install as root: apt-get install ${missing[*]}" >&2; exit 1; }
    SUDO=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  APT=("${SUDO[@]}" apt-get -q -o DPkg::Lock::Timeout=600)
  "${APT[@]}" update
  "${APT[@]}" install -y --no-install-recommends "${missing[@]}"
else
  echo "apt packages: all installed"
fi

CACHE="${BANYAN_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/banyan-tools}"
BUF_DIR="$CACHE/buf-$BUF_VERSION"
BUF="$BUF_DIR/node_modules/.bin/buf"
if ! [ -x "$BUF" ] || ! "$BUF" --version >/dev/null 2>&1; then
  echo "installing @bufbuild/buf@$BUF_VERSION with npm into $BUF_DIR"
  mkdir -p "$CACHE"
  tmp="$(mktemp -d "$CACHE/.buf-XXXXXX")"
  npm install --prefix "$tmp" --no-audit --no-fund --loglevel=error "@bufbuild/buf@$BUF_VERSION"
  "$tmp/node_modules/.bin/buf" --version >/dev/null
  rm -rf "$BUF_DIR" && mv "$tmp" "$BUF_DIR"  # whole or not at all
fi
BIN="$CACHE/bin"
mkdir -p "$BIN"
ln -sfn "$BUF" "$BIN/buf"
ln -sfn /usr/bin/grpc_java_plugin "$BIN/protoc-gen-grpc-java"  # the name buf.gen.yaml (and protoc) look for
echo "bin: $BIN (export PATH=\"$BIN:\$PATH\" for buf generate)"
echo "buf: $BUF"
