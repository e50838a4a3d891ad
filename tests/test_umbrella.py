"""The umbrella's CLI and package table."""

import subprocess
import sys

from tilestack.cli import main
from tilestack.doctor import backend_status, report
from tilestack.packages import PACKAGES, installed_version


def test_every_package_is_installed_and_versioned():
    for pkg in PACKAGES:
        assert installed_version(pkg) is not None, pkg.dist


def test_doctor_reports_devices_compilers_packages_backends():
    text = report()
    for heading in ("Devices:", "Compilers:", "Packages:", "Backends:"):
        assert heading in text
    for pkg in PACKAGES:
        assert pkg.dist in text
    names = [name for name, _, _ in backend_status()]
    assert any(n.startswith("cpu") for n in names) and "cuda launch" in names


def test_doctor_explains_unusable_backends():
    for name, ok, why in backend_status():
        assert ok or why, f"{name} is unusable but doctor does not say why"


def test_cli_doctor_exit_code(capsys):
    assert main(["doctor"]) == 0
    assert "TileStack doctor" in capsys.readouterr().out


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "tilestack", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Backends:" in out.stdout


def test_demo_runs_every_package_example(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for pkg in PACKAGES:
        assert f"== {pkg.module}: ok" in out, out
