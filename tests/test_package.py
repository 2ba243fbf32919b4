"""The package as a wheel installs it: the shipped default model travels inside it, and
`jaxmtp generate` finds it from another folder with no checkout around."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from conftest import ROOT


def test_a_wheel_install_generates_with_the_shipped_model_from_another_folder(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"),
         str(ROOT)], capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel, = (tmp_path / "wheel").glob("jaxmtp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for model in ("stories260K", "stories260K-mtp"):
        shipped = {p.relative_to(ROOT / "checkpoints").as_posix() for p in (ROOT / "checkpoints" / model).rglob("*") if p.is_file()}
        assert shipped <= {n.removeprefix("jaxmtp/checkpoints/") for n in names}, model
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    script = ("import sys, jaxmtp; from jaxmtp.cli import main; print(jaxmtp.__file__); "
              "sys.exit(main(['generate', 'Once upon a time', '--max-tokens', '8', '--max-num-seqs', '1', "
              "'--max-num-batched-tokens', '16']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr[-2000:]
    installed, text = out.stdout.split("\n", 1)
    assert installed.startswith(str(site)) and text.startswith("Once upon a time,"), out.stdout
