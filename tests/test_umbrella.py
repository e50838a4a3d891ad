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
    assert main(["demo", "--examples"]) == 0
    out = capsys.readouterr().out
    for pkg in PACKAGES:
        assert f"== {pkg.module}: ok" in out, out


def test_bench_skips_gpu_scripts_without_a_gpu(tmp_path):
    from tilestack.bench import find_scripts, missing, requirement

    script = tmp_path / "packages" / "x" / "benchmarks" / "bench_x.py"
    script.parent.mkdir(parents=True)
    script.write_text("# requires: cuda\nprint('hi')\n")
    assert find_scripts(tmp_path) == [script]
    assert requirement(script) == "cuda"
    assert missing("cuda", 0) == "needs a CUDA GPU"
    assert missing("multi_gpu", 1).startswith("needs two or more")
    assert missing(None, 0) is None and missing("cuda", 1) is None
