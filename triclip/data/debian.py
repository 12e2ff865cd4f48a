"""Debian packages that built-in datasets come from: installed with apt-get when missing and possible."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from triclip.core.errors import UserError


def ensure_debian_packages(required: dict[str, str]) -> None:
    """Make sure each Debian package's folder exists, installing the missing packages as root.

    Args:
        required: package name -> a folder it provides.

    Raises:
        UserError: a package is missing and cannot be installed here, with the command to run.
    """
    missing = sorted(pkg for pkg, folder in required.items() if not os.path.isdir(folder))
    if not missing:
        return
    command = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    advice = f"install the Debian package(s) {' '.join(missing)}: sudo apt-get install {' '.join(missing)}"
    if not _can_install():
        raise UserError(f"missing data; {advice}")
    print(f"installing {' '.join(missing)} with apt-get", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    done = subprocess.run(command, stdout=sys.stderr, env=env).returncode == 0
    if not done:  # maybe stale package lists
        subprocess.run(["apt-get", "update", "-qq"], stdout=sys.stderr, env=env)
        done = subprocess.run(command, stdout=sys.stderr, env=env).returncode == 0
    still = [pkg for pkg in missing if not os.path.isdir(required[pkg])]
    if not done or still:
        raise UserError(f"apt-get could not install the data; {advice}")


def _can_install() -> bool:
    """Root with apt-get available (the only case where installing is possible without asking)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None
