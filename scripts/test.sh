#!/usr/bin/env bash
# Install what the test suite needs on a fresh machine, then run it.
#   bash scripts/test.sh [pytest args...]
# Debian packages (prometheus, promtool, alertmanager, victoria-metrics, chromium) are installed
# when this runs as root; otherwise the tests that need them are skipped with a reason naming
# the package to install.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES=(prometheus prometheus-alertmanager victoria-metrics chromium)
missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "== not root: cannot install ${missing[*]}; tests needing them will be skipped" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
echo "== installing syncwatch with the torch and test extras"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[torch,test]"

echo "== running the tests"
exec .venv/bin/python -m pytest -q -ra "$@"
