"""`python -m tilehal doctor`: the report any single package can print, and clash detection."""

import subprocess
import sys

from tilehal import doctor


def _fake_distribution(root, name, version, files):
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files) + f"{info.name}/RECORD,,\n")
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")


def test_report_sections_and_every_distribution():
    text = doctor.report()
    for heading in ("Devices:", "Compilers:", "Packages:", "Backends:", "Import-name clashes:"):
        assert heading in text
    for dist in doctor.DISTRIBUTIONS:
        assert dist in text
    for name, ok, why in doctor.backend_status():
        assert ok or why, f"{name} is unusable but the report does not say why"


def test_clash_with_another_distribution_is_reported(tmp_path, monkeypatch, capsys):
    assert all(c.module != "tilelang" for c in doctor.clashes())
    _fake_distribution(tmp_path, "tilelang", "0.1.15", ["tilelang/__init__.py", "tilelang/jit/__init__.py"])
    _fake_distribution(tmp_path, "unrelated", "1.0", ["unrelated/__init__.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    found = [c for c in doctor.clashes() if c.module == "tilelang"]
    assert len(found) == 1 and found[0].others == ("tilelang 0.1.15",) and found[0].ours == "tilestack-tilelang"
    assert not any(c.module == "unrelated" for c in doctor.clashes())
    assert doctor.main() == 1
    out = capsys.readouterr().out
    assert "tilelang: files also belong to tilelang 0.1.15" in out and "pip uninstall -y tilelang tilestack-tilelang" in out


def test_python_dash_m_tilehal_doctor():
    out = subprocess.run([sys.executable, "-m", "tilehal", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == (1 if doctor.clashes() else 0), out.stderr
    assert "Import-name clashes:" in out.stdout and "Backends:" in out.stdout
