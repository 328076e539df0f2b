#!/usr/bin/env bash
# System packages the test suite uses, from Debian's archive: chromium (the HTML report opened in a real
# browser) and bubblewrap (the sandbox for generated code). Idempotent and quiet; skips what is present;
# never fails the set-up (tests that need a missing tool say so and skip).
set -u
want=()
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || want+=(chromium)
command -v bwrap >/dev/null 2>&1 || want+=(bubblewrap)
[ ${#want[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "note: apt-get not found; install ${want[*]} yourself for the browser and sandbox tests" >&2
  exit 0
fi
sudo=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo -n"
echo "installing system packages: ${want[*]}" >&2
$sudo apt-get update -qq >/dev/null 2>&1 || true
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null 2>&1 \
  || echo "note: could not install ${want[*]}; the tests that need them will be skipped" >&2
exit 0
