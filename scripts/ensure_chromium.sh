#!/usr/bin/env bash
# Headless Chromium and its WebDriver for the playground's browser test (tests/browser.py).
# Installs Debian's chromium and chromium-driver with apt-get only when /usr/bin/chromium or
# /usr/bin/chromedriver is missing (needs root). Exits 0 when both are present afterwards.
set -u

CHROMIUM=/usr/bin/chromium
DRIVER=/usr/bin/chromedriver

present() { [ -x "$CHROMIUM" ] && [ -x "$DRIVER" ]; }

if present; then
    echo "ensure_chromium: $CHROMIUM and $DRIVER already present; nothing to do"
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "ensure_chromium: $CHROMIUM or $DRIVER is missing and this is not root: cannot apt-get install" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: $CHROMIUM or $DRIVER is missing and there is no apt-get" >&2
    exit 1
fi

echo "ensure_chromium: installing chromium and chromium-driver (apt-get)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q || echo "ensure_chromium: apt-get update failed; trying the install anyway" >&2
apt-get install -y -q --no-install-recommends chromium chromium-driver

if present; then
    echo "ensure_chromium: installed $("$CHROMIUM" --version 2>/dev/null || echo chromium)"
    exit 0
fi
echo "ensure_chromium: $CHROMIUM or $DRIVER still missing after apt-get install" >&2
exit 1
