#!/usr/bin/env bash
# Offline build of the Go client from Debian's packages (scripts/install_client_toolchains.sh):
# protoc + protoc-gen-go + protoc-gen-go-grpc generate the stubs from protos/, and `go build`
# runs in GOPATH mode against the sources Debian installs under /usr/share/gocode — no module
# proxy, no network. Everything it writes goes under BUILD_DIR (default clients/go/build).
#
#   clients/go/build.sh [BUILD_DIR]    → BUILD_DIR/banyan-client
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BUILD="$(mkdir -p "${1:-$HERE/build}" && cd "${1:-$HERE/build}" && pwd)"
PKG=github.com/banyan-ai/banyan/clients/go  # the module path in go.mod; go_package in the proto
for tool in protoc protoc-gen-go protoc-gen-go-grpc go; do
  command -v "$tool" >/dev/null || { echo "missing $tool: run scripts/install_client_toolchains.sh" >&2; exit 1; }
done
GOPATH_DIR="$BUILD/gopath"
SRC="$GOPATH_DIR/src/$PKG"
rm -rf "$SRC" && mkdir -p "$SRC"
# paths=import: files land under their go_package import path, i.e. $SRC/gen/banyan/v1
(cd "$ROOT/protos" && protoc -I . --go_out="$GOPATH_DIR/src" --go-grpc_out="$GOPATH_DIR/src" \
  $(find . -name '*.proto' | sed 's|^\./||' | sort))
cp "$HERE/main.go" "$SRC/"
export GO111MODULE=off GOPROXY=off GOFLAGS= GOPATH="$GOPATH_DIR:/usr/share/gocode"
cd "$SRC"
unformatted="$(gofmt -l main.go)"
[ -z "$unformatted" ] || { echo "not gofmt-formatted: $unformatted" >&2; exit 1; }
go vet .
go build -o "$BUILD/banyan-client" .
echo "built $BUILD/banyan-client"
