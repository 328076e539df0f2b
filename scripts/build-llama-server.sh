#!/usr/bin/env bash
# Kept for older instructions: builds llama.cpp's tools, llama-server among them (scripts/build-llama-cpp.sh).
exec "$(dirname "$0")/build-llama-cpp.sh" "$@"
