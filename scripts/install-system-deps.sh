#!/usr/bin/env sh
# System packages infer-tune's tests need, from Debian's archive: bubblewrap (the OS sandbox `bench --execute` runs generated
# code in) and chromium (the HTML report opened in a real browser). Idempotent and quiet; a machine without apt (or without root and sudo) is left as it is,
# with a note (the sandbox tests then fail on CI, and `--execute` refuses with the install command).
set -u
PACKAGES="bubblewrap chromium"

missing=""
for pkg in $PACKAGES; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
done
[ -z "$missing" ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system-deps: no apt-get here; install$missing with your package manager" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install-system-deps: not root and no passwordless sudo; run: apt-get install$missing" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null 2>&1 || true
if ! $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1; then
    echo "install-system-deps: apt-get install$missing failed" >&2
fi
exit 0
