"""The `jaxmtp` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxmtp.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_generate_prints_a_story():
    result = run_cli("generate", "Once upon a time", "--max-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon a time, there was a little girl named Lily.")


def test_generate_reports_bad_input_without_a_traceback():
    result = run_cli("generate", "Once", "--max-tokens", "0")
    assert result.returncode == 2
    assert "max_tokens must be an integer >= 1" in result.stderr
    assert "Traceback" not in result.stderr
