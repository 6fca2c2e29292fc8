"""scripts/test.sh, the README's test command (and CI's, through .ci/run), on a fresh machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from deploy_helpers import ROOT

DEBIAN_PYTHON = "/usr/bin/python3"
# The standard library ($1) without ensurepip, as a minimal Debian has it: an overlay whose upper
# layer holds a whiteout in its place (scratch on a tmpfs at $2), then the command after them.
WITHOUT_ENSUREPIP = r"""
set -e
mkdir "$2"
mount -t tmpfs tmpfs "$2"
mkdir "$2/upper" "$2/work"
mknod "$2/upper/ensurepip" c 0 0
mount -t overlay overlay -o "lowerdir=$1,upperdir=$2/upper,workdir=$2/work" "$1"
shift 2
exec "$@"
"""


def test_ci_runs_the_readme_test_command():
    assert "exec bash scripts/test.sh\n" in (ROOT / ".ci" / "run").read_text()
    assert "```sh\nbash scripts/test.sh\n```" in (ROOT / "README.md").read_text()


def test_without_ensurepip_it_names_the_venv_package_before_making_the_venv():
    """On a fresh Debian 12, ``python3 -m venv`` fails ("ensurepip is not available"): ensurepip
    is in python3.11-venv, which a minimal install lacks. test.sh went on to make .venv all the
    same; it now adds the package of the Python it runs to the Debian packages it installs as
    root, and, not root, stops before making .venv and names it. Run here as nobody, with
    ensurepip taken out of the standard library in a private mount namespace."""
    if not Path(DEBIAN_PYTHON).is_file():
        pytest.skip(f"needs Debian's {DEBIAN_PYTHON}")
    probe = ("import ensurepip, sys, sysconfig; "
             "print(sysconfig.get_default_scheme(), ensurepip.__path__[0], *sys.version_info[:2])")
    out = subprocess.run([DEBIAN_PYTHON, "-c", probe], capture_output=True, text=True).stdout.split()
    if len(out) != 4 or out[0] != "posix_local":
        pytest.skip(f"needs Debian's {DEBIAN_PYTHON} (posix_local install scheme) with ensurepip")
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root and unshare, setpriv (util-linux)")
    _, ensurepip_dir, major, minor = out
    with tempfile.TemporaryDirectory() as checkout:  # in /tmp: nobody reaches it
        (Path(checkout) / "scripts").mkdir()
        shutil.copy(ROOT / "scripts" / "test.sh", Path(checkout) / "scripts")
        for path in (checkout, f"{checkout}/scripts"):
            os.chown(path, 65534, 65534)
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", WITHOUT_ENSUREPIP,
             "sh", os.path.dirname(ensurepip_dir), f"{checkout}/overlay", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             "bash", f"{checkout}/scripts/test.sh"],
            capture_output=True, text=True, timeout=60,
            env={"PATH": os.environ["PATH"], "PYTHON": DEBIAN_PYTHON})
        made_venv = (Path(checkout) / ".venv").exists()
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"{DEBIAN_PYTHON} -m venv needs python{major}.{minor}-venv (ensurepip)" in output, output
    assert "== creating .venv" not in output and not made_venv, output

