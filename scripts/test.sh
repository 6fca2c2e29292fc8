#!/usr/bin/env bash
# Install what the test suite needs on a fresh machine, then run it.
#   bash scripts/test.sh [pytest args...]
# Debian packages (prometheus, promtool, alertmanager, victoria-metrics, chromium, and
# pythonX.Y-venv where python3 cannot make a virtual environment) are installed when this runs as
# root; otherwise the tests that need them are skipped with a reason naming the package to
# install (without the venv package it stops: nothing runs without .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEBIAN_PACKAGES=(prometheus prometheus-alertmanager victoria-metrics chromium)
missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# Debian's and Ubuntu's Python make a virtual environment only with ensurepip, which is in the
# package pythonX.Y-venv (python3-venv depends on the default version's)
venv_package=
if [ ! -x .venv/bin/python ] && ! "$PY" -c 'import ensurepip' 2>/dev/null; then
  venv_package=$("$PY" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')
  missing+=("$venv_package")
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  elif [ -n "$venv_package" ]; then
    echo "== not root: cannot install ${missing[*]}; $PY -m venv needs $venv_package (ensurepip)" >&2
    exit 1
  else
    echo "== not root: cannot install ${missing[*]}; tests needing them will be skipped" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
echo "== installing syncwatch with the torch and test extras"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[torch,test]"

echo "== running the tests"
exec .venv/bin/python -m pytest -q -ra "$@"
