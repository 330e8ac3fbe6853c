#!/usr/bin/env bash
# Offline build of the Java client from Debian's packages (scripts/install_client_toolchains.sh):
# protoc + Debian's gRPC Java plugin (/usr/bin/grpc_java_plugin) generate the stubs from protos/
# (and the standard grpc.health.v1 proto vendored in proto/, since Debian has no grpc-services
# jar), and javac compiles them with a classpath of jars from /usr/share/java — no Maven or
# Gradle, no network. Everything it writes goes under BUILD_DIR (default clients/java/build).
#
#   clients/java/build.sh [BUILD_DIR]    → BUILD_DIR/banyan-client (a launcher script)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BUILD="$(mkdir -p "${1:-$HERE/build}" && cd "${1:-$HERE/build}" && pwd)"
JAVA_DIR=/usr/share/java
GRPC_JAVA_PLUGIN="${GRPC_JAVA_PLUGIN:-/usr/bin/grpc_java_plugin}"
# Runtime classpath: gRPC (libgrpc-java) over the Netty transport (libnetty-java), protobuf
# (libprotobuf-java), guava with failureaccess inside (libguava-java), perfmark (libperfmark-java),
# gson for service configs (libgoogle-gson-java), and javax.annotation.Generated for the
# generated stubs (libgeronimo-annotation-1.3-spec-java).
JARS=(grpc-api grpc-context grpc-core grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub
      protobuf guava perfmark-api gson geronimo-annotation-1.3-spec
      netty-buffer netty-codec netty-codec-http netty-codec-http2 netty-codec-socks netty-common
      netty-handler netty-handler-proxy netty-resolver netty-transport)
# Compile only: annotations on guava/grpc classes (javac warns when it cannot see them).
COMPILE_JARS=(error_prone_annotations)
for tool in protoc javac java "$GRPC_JAVA_PLUGIN"; do
  command -v "$tool" >/dev/null || { echo "missing $tool: run scripts/install_client_toolchains.sh" >&2; exit 1; }
done
classpath() {
  local cp="" j
  for j in "$@"; do
    [ -f "$JAVA_DIR/$j.jar" ] || { echo "missing $JAVA_DIR/$j.jar: run scripts/install_client_toolchains.sh" >&2; exit 1; }
    cp="$cp${cp:+:}$JAVA_DIR/$j.jar"
  done
  echo "$cp"
}
CP="$(classpath "${JARS[@]}")"
COMPILE_CP="$CP:$(classpath "${COMPILE_JARS[@]}")"
rm -rf "$BUILD/gen" "$BUILD/classes" && mkdir -p "$BUILD/gen" "$BUILD/classes"
protos() { (cd "$1" && find . -name '*.proto' | sed 's|^\./||' | sort); }
# Two runs, one per root, so each file is named relative to its own -I.
for dir in "$ROOT/protos" "$HERE/proto"; do
  (cd "$dir" && protoc -I . --java_out="$BUILD/gen" --plugin=protoc-gen-grpc-java="$GRPC_JAVA_PLUGIN" \
    --grpc-java_out="$BUILD/gen" $(protos "$dir"))
done
find "$BUILD/gen" "$HERE/src/main/java" -name '*.java' | sort > "$BUILD/sources.txt"
javac -encoding UTF-8 --release 17 -Xlint:all,-processing,-options -d "$BUILD/classes" -cp "$COMPILE_CP" @"$BUILD/sources.txt"
cat > "$BUILD/banyan-client" <<LAUNCHER
#!/bin/sh
exec java -cp "$BUILD/classes:$CP" ai.banyan.client.BanyanClient "\$@"
LAUNCHER
chmod +x "$BUILD/banyan-client"
echo "built $BUILD/banyan-client"
