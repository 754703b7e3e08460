#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp tree vendored in the
# llama-cpp-python sdist (the package registry is the only network this needs),
# for the comparisons against it (benchmarks/serving/fim_latency.py and
# server_side_by_side.py's llama-server parts).
#
# Usage: benchmarks/serving/build_llama_server.sh [BUILD_DIR]   (default /work/llama-server)
# Prints the path of the built binary; writes BUILD_DIR/build-info.txt with the
# version and cmake flags used (both reports quote it).
set -euo pipefail

VERSION="0.3.36"
BUILD_DIR="${1:-/work/llama-server}"
CMAKE_FLAGS=(
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
  -DGGML_AVX512_BF16=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
)

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
if ! ls llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
  # --no-binary for this package only: the build dependencies pip prepares its metadata with come as wheels
  pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d .
fi
SRC="$BUILD_DIR/llama_cpp_python-$VERSION"
[ -d "$SRC" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
LLAMA_SRC="$SRC/vendor/llama.cpp"
[ -f "$LLAMA_SRC/CMakeLists.txt" ] || { echo "no vendored llama.cpp in $SRC" >&2; exit 1; }

cmake -S "$LLAMA_SRC" -B "$BUILD_DIR/build" "${CMAKE_FLAGS[@]}"
cmake --build "$BUILD_DIR/build" --target llama-server -j2

BIN="$BUILD_DIR/build/bin/llama-server"
[ -x "$BIN" ] || { echo "build finished but $BIN is missing" >&2; exit 1; }
LLAMA_COMMIT="$(grep -rhoE 'LLAMA_BUILD_COMMIT[^)]*' "$BUILD_DIR/build/common/build-info.cpp" 2>/dev/null | head -1 || true)"
{
  echo "source: llama-cpp-python==$VERSION sdist (vendored llama.cpp)"
  echo "cmake_flags: ${CMAKE_FLAGS[*]} --target llama-server -j2"
  echo "compiler: $(c++ --version | head -1)"
  echo "built_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  [ -n "$LLAMA_COMMIT" ] && echo "llama_build: $LLAMA_COMMIT"
} > "$BUILD_DIR/build/bin/build-info.txt"
echo "$BIN"
