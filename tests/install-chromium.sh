#!/bin/sh
# Debian's chromium and chromium-driver, for the chat page's browser test (make test runs this).
# Does nothing when both are installed.
set -eu
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
