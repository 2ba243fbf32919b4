"""The package as a wheel installs it: the shipped default model travels inside it, and
`jaxmtp generate` finds it from another folder with no checkout around. The kernels/
folder installs as jaxmtp.kernels (PyPI has a top-level `kernels`), from a wheel and
from an editable install."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import ROOT


def test_a_wheel_install_generates_with_the_shipped_model_from_another_folder(tmp_path):
    # built from a copy: setuptools packs whatever an earlier build left in build/lib
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"),
         str(source)], capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel, = (tmp_path / "wheel").glob("jaxmtp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("kernels/")], "kernels/ must not install as a top-level package"
    kernel_files = {f"jaxmtp/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")}
    assert kernel_files and kernel_files <= set(names)
    for model in ("stories260K", "stories260K-mtp"):
        shipped = {p.relative_to(ROOT / "checkpoints").as_posix() for p in (ROOT / "checkpoints" / model).rglob("*") if p.is_file()}
        assert shipped <= {n.removeprefix("jaxmtp/checkpoints/") for n in names}, model
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    assert not (site / "kernels").exists()
    script = ("import sys, jaxmtp, jaxmtp.kernels; from jaxmtp.cli import main; "
              "print(jaxmtp.__file__, jaxmtp.kernels.__file__); "
              "sys.exit(main(['generate', 'Once upon a time', '--max-tokens', '8', '--max-num-seqs', '1', "
              "'--max-num-batched-tokens', '16']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr[-2000:]
    installed, text = out.stdout.split("\n", 1)
    package, kernels = installed.split()
    assert package == str(site / "jaxmtp" / "__init__.py") and kernels == str(site / "jaxmtp" / "kernels" / "__init__.py")
    assert text.startswith("Once upon a time,"), out.stdout


def test_an_editable_install_maps_jaxmtp_kernels_to_the_kernels_folder(tmp_path):
    """pip install -e . (CI and the GPU machine run from the source tree so): setuptools'
    finder maps jaxmtp.kernels to kernels/, and no top-level `kernels`. Installed into a
    venv made here that sees this interpreter's packages through a .pth file (its pip and
    setuptools build the install; --system-site-packages would give the base Python's,
    not this environment's), so the shared install is left alone."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
    (Path(venv_site) / "outer_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                              str(ROOT)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    finder, = (venv / "lib").glob("python*/site-packages/__editable___jaxmtp_*_finder.py")
    mapping = next(line for line in finder.read_text().splitlines() if line.startswith("MAPPING"))
    assert f"'jaxmtp.kernels': '{ROOT / 'kernels'}'" in mapping and "'kernels'" not in mapping, mapping
    script = "import jaxmtp.kernels.reference as ref; print(ref.__file__)"
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == str(ROOT / "kernels" / "reference.py"), out.stderr[-2000:]
