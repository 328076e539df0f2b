#!/usr/bin/env bash
# Build llama.cpp's OpenAI-compatible C++ server (`llama-server`) from the llama.cpp source that the
# llama-cpp-python sdist on PyPI vendors, for `endpoint reference --engine llama.cpp --parallel N`
# (docs/endpoint.md). The binary lands in $INFER_TUNE_HOME/bin/llama-server (default
# ~/.cache/infer-tune/bin), never in the repository.
#
#   scripts/build-llama-server.sh                 # download, configure, build (10+ minutes on 2 cores)
#   JOBS=2 TIME_LIMIT=540 scripts/build-llama-server.sh   # stop after 540 s; rerun to continue
#   GGML_AMX=ON scripts/build-llama-server.sh     # keep llama.cpp's AMX kernels (default OFF, see below)
#
# GGML_NATIVE builds for this CPU. On an AMX-capable Xeon (a 2-core VM, this llama.cpp version) the AMX
# matmul kernel crashed the server while it warmed up (SIGSEGV in ggml_backend_amx_mul_mat), so AMX
# is compiled out by default (-mno-amx-*); AVX-512 / VNNI and llama.cpp's weight repacking stay.
#
# Rerunning resumes: the unpacked source and the cmake build folder are kept under
# $INFER_TUNE_HOME/build/, so a build cut by TIME_LIMIT (exit 75) continues where it stopped.
# Needs cmake and a C++ compiler (scripts/install-system-deps.sh); HTTPS and curl are off (loopback only).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
TIME_LIMIT="${TIME_LIMIT:-0}"          # seconds for the compile step; 0 = no limit
PYTHON="${PYTHON:-python3}"
HOME_DIR="${INFER_TUNE_HOME:-$HOME/.cache/infer-tune}"
HOME_DIR="${HOME_DIR/#\~/$HOME}"
WORK="$HOME_DIR/build/llama-server-$VERSION"
BIN_DIR="$HOME_DIR/bin"

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "error: $tool is not installed (see scripts/install-system-deps.sh)" >&2; exit 2; }
done
(umask 077 && mkdir -p "$WORK" "$BIN_DIR")  # private folders: infer-tune refuses to run a binary others could swap

SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "downloading llama-cpp-python==$VERSION (source distribution) from PyPI"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$WORK/sdist"
  tar -xzf "$WORK/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi
[ -f "$SRC/CMakeLists.txt" ] || { echo "error: no llama.cpp source in the sdist ($SRC)" >&2; exit 2; }

GGML_AMX="${GGML_AMX:-OFF}"
FLAGS=""
if [ "$GGML_AMX" != "ON" ] && grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
  FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
BUILD="$WORK/build"
STAMP="native $FLAGS"
if [ -f "$BUILD/CMakeCache.txt" ] && [ "$(cat "$WORK/flags" 2>/dev/null)" != "$STAMP" ]; then
  echo "compiler flags changed ($STAMP): configuring again"
  rm -rf "$BUILD"
fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  echo "$STAMP" >"$WORK/flags"
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF >"$WORK/configure.log" 2>&1 \
    || { tail -20 "$WORK/configure.log" >&2; echo "error: cmake configure failed (log: $WORK/configure.log)" >&2; exit 1; }
fi

echo "building llama-server with $JOBS jobs (log: $WORK/build.log)"
build=(cmake --build "$BUILD" --config Release --target llama-server -j "$JOBS")
status=0
if [ "$TIME_LIMIT" -gt 0 ]; then
  timeout "$TIME_LIMIT" "${build[@]}" >>"$WORK/build.log" 2>&1 || status=$?
else
  "${build[@]}" >>"$WORK/build.log" 2>&1 || status=$?
fi
if [ "$status" -eq 124 ]; then
  echo "stopped after ${TIME_LIMIT}s; rerun to continue the build"
  exit 75
elif [ "$status" -ne 0 ]; then
  tail -20 "$WORK/build.log" >&2
  echo "error: the build failed (log: $WORK/build.log)" >&2
  exit 1
fi
install -m 0755 "$BUILD/bin/llama-server" "$BIN_DIR/llama-server.partial"
mv "$BIN_DIR/llama-server.partial" "$BIN_DIR/llama-server"
echo "built $BIN_DIR/llama-server ($("$BIN_DIR/llama-server" --version 2>&1 | grep -m1 version || echo "llama.cpp from llama-cpp-python $VERSION"))"
