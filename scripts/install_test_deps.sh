#!/usr/bin/env bash
# System packages the test suite needs beyond the Python environment:
# headless Chromium, which tests/course/test_book.py uses to render the built book.
# Idempotent: does nothing where /usr/bin/chromium already exists.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_test_deps: /usr/bin/chromium is missing and apt-get is not available;" >&2
  echo "install Chromium with your system's package manager." >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

echo "install_test_deps: installing chromium (headless browser for the book test)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "install_test_deps: $(/usr/bin/chromium --version 2>/dev/null || echo chromium installed)"
