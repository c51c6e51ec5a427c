"""Shared fixtures for the reference tests: where the build is, and tiny random HF models per architecture."""
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("TANDEM_BUILD_DIR", ROOT / "build"))


def tool(name):
    """Path of a helper executable built from tests/reference/tools/<name>.c; skips the test when not built."""
    path = BUILD / "tests" / name
    if not path.exists():
        pytest.skip(f"{path} is not built (run scripts/test.sh, or set TANDEM_BUILD_DIR)")
    return str(path)


def run_tool(args, stdin=None, timeout=300):
    proc = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout
