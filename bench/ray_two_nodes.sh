#!/usr/bin/env bash
# The --executor ray check on two Ray nodes started on this machine (a head and one more, loopback): a
# 4-config recipe with keys identical to the local executor, a worker killed mid-config retried, every config
# landed once. About a minute on 2 cores; left out of `make test` to keep the suite inside its time.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -m cluster tests/test_ray_executor.py "$@"
