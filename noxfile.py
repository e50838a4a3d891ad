"""Every dev task of the monorepo: `nox -l` lists them.

The README's two commands are `nox -s demo` (the main job) and `nox -s lint tests isolation
wheels readme_install` (all tests; what .ci/run runs). GPU tests run on the GPU machine with
`nox -s gpu`, or without nox: `source scripts/device_env.sh && python3 -m pytest -m gpu packages tests`.

Interpreter: the one running nox when it is a supported Python (>= 3.10), else the first working
python3.1x on PATH; with none, every session fails (a skipped session is an error).

Repeated runs: environments are kept in .nox/ and reused; a session reinstalls only when what it
installs changed (its arguments, constraints.txt, the pyproject.toml files, and for non-editable
installs the package's sources). `nox -N` (or deleting .nox/) starts from scratch. On CI (CI set) each
environment is removed when its session ends: a clean clone runs once, and the disk is small.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests", "isolation", "wheels", "readme_install"]
nox.options.reuse_venv = "yes"
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.download_python = "never"

ROOT = Path(__file__).resolve().parent
MIN_PYTHON = (3, 10)
CONSTRAINTS = ("-c", "constraints.txt")
# Import name -> folder; order is the layering (tilehal first).
PACKAGES = {"tilehal": "hal", "tilelang": "tilelang", "deepgemm": "deepgemm", "deepep": "deepep",
            "kvpool": "kvpool", "dataengine": "dataengine"}
DISTS = {"tilehal": "tilestack-hal", "tilelang": "tilestack-tilelang", "deepgemm": "tilestack-deepgemm",
         "deepep": "tilestack-deepep", "kvpool": "tilestack-kvpool", "dataengine": "tilestack-dataengine",
         "tilestack": "tilestack"}
CPU_MARKERS = "not gpu and not multi_gpu and not slow"
# Every nox test run replays the same hypothesis examples (root conftest.py's "ci" profile).
TEST_ENV = {"HYPOTHESIS_PROFILE": "ci"}


def _version_of(exe: str) -> tuple[int, int] | None:
    """(major, minor) of a working interpreter, None for a missing one or a dangling shim."""
    try:
        out = subprocess.run([exe, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    return (int(parts[0]), int(parts[1])) if out.returncode == 0 and len(parts) == 2 else None


def _pick_python() -> str:
    if sys.version_info[:2] >= MIN_PYTHON:
        return sys.executable
    for minor in range(14, MIN_PYTHON[1] - 1, -1):
        exe = shutil.which(f"python3.{minor}")
        if exe and (_version_of(exe) or (0, 0)) >= MIN_PYTHON:
            return exe
    # Named but absent: with error_on_missing_interpreters every session then fails, loudly.
    return f"python{MIN_PYTHON[0]}.{MIN_PYTHON[1]}"


PYTHON = _pick_python()


def _digest(args: tuple[str, ...]) -> str:
    """What an install depends on: its arguments, the pins, every pyproject.toml, and the files of
    each local path installed non-editable (an editable install follows its sources by itself)."""
    h = hashlib.sha256(repr(args).encode())
    files = [ROOT / "constraints.txt", ROOT / "pyproject.toml", *sorted(ROOT.glob("packages/*/pyproject.toml"))]
    editable = False
    for a in args:
        if a == "-e":
            editable = True
            continue
        local = ROOT / a.split("[")[0]
        if not editable and a.startswith(("packages/", ".")) and local.is_dir():
            files += sorted(p for p in local.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        editable = False
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes() if f.exists() else b"")
    return h.hexdigest()


def _install(session: nox.Session, *args: str) -> None:
    """pip install with its output shown (progress during the long torch install), skipped when the
    reused environment already holds exactly this install."""
    stamp = Path(session.virtualenv.location) / ".tilestack-install"
    key = _digest(args)
    if stamp.exists() and stamp.read_text() == key:
        session.log("environment up to date (same install arguments, pins and sources): install skipped")
        return
    stamp.unlink(missing_ok=True)
    session.install(*args, silent=False)
    # With `nox -R` (--no-install) nox skipped the install above: do not mark it done.
    if not getattr(getattr(session, "_runner", None) and session._runner.global_config, "no_install", False):
        stamp.write_text(key)


@contextlib.contextmanager
def _released_in_ci(session: nox.Session):
    """On CI (a clean clone, run once) drop the session's environment when it ends, passed or not:
    twelve environments holding torch take ~13 GB, more than a CI disk may have free. Locally
    they stay for reuse."""
    try:
        yield
    finally:
        if os.environ.get("CI"):
            session.log(f"CI: removing {session.virtualenv.location} to free disk")
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _install_everything(session: nox.Session) -> None:
    editable = ["-e", "packages/hal[torch,cuda,test]"]
    for folder in list(PACKAGES.values())[1:]:
        editable += ["-e", f"packages/{folder}[test]"]
    _install(session, *CONSTRAINTS, *editable, "-e", ".[hf,bench]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All CPU tests of every package and the cross-package tests, in one environment."""
    with _released_in_ci(session):
        _install_everything(session)
        paths = [f"packages/{f}/tests" for f in PACKAGES.values()] + ["tests"]
        session.run("pytest", "-n", "2", "--dist", "loadfile", "-m", CPU_MARKERS, "-q", *paths, *session.posargs,
                    env=TEST_ENV)


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES))
def isolation(session: nox.Session, package: str) -> None:
    """A fresh environment with only `package` and tilehal: it installs alone and its tests pass."""
    with _released_in_ci(session):
        _isolated_package_tests(session, package)


def _isolated_package_tests(session: nox.Session, package: str) -> None:
    folder = PACKAGES[package]
    if package == "tilehal":
        _install(session, *CONSTRAINTS, "packages/hal[test]")
        # tilehal alone must not pull torch in.
        session.run("python", "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)")
    else:
        _install(session, *CONSTRAINTS, "packages/hal[cuda]", f"packages/{folder}[test]")
    session.run("python", "-c", f"import {package}; print({package}.__name__, {package}.__version__)")
    session.run("pytest", "-n", "2", "--dist", "loadfile", "-m", CPU_MARKERS, "-q", f"packages/{folder}/tests",
                *session.posargs, env=TEST_ENV)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    _install(session, *CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def wheels(session: nox.Session) -> None:
    """Build every distribution's wheel into dist/ (what `pip install --find-links dist ...` reads)."""
    _install(session, "hatchling")
    dist = ROOT / "dist"
    for old in dist.glob("tilestack*.whl"):
        old.unlink()
    for path in [f"packages/{f}" for f in PACKAGES.values()] + ["."]:
        session.run("python", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), path)
    built = sorted(p.name for p in dist.glob("tilestack*.whl"))
    session.log("built: " + ", ".join(built))
    if len(built) != len(DISTS):
        session.error(f"expected {len(DISTS)} wheels in dist/, got {len(built)}")


@nox.session(python=PYTHON)
@nox.parametrize("package", list(DISTS))
def readme_install(session: nox.Session, package: str) -> None:
    """The README's install command (wheels from dist/, torch from the CI pin) in an environment
    of its own, then the doctor and the README's example, run from outside the checkout.

    The first run (and every CI run: a clean clone) starts from an empty environment; a repeated
    local run keeps the third-party packages and reinstalls every tilestack-* one from dist/.
    """
    if not list((ROOT / "dist").glob("tilestack*.whl")):
        session.error("dist/ holds no wheels: run `nox -s wheels` first")
    with _released_in_ci(session):
        _readme_install_and_example(session, package)


def _readme_install_and_example(session: nox.Session, package: str) -> None:
    session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *DISTS.values(), silent=True)
    session.install(*CONSTRAINTS, "--find-links", "dist", DISTS[package], silent=False)
    env = {"PYTHONPATH": None, **TEST_ENV}
    work = Path(tempfile.mkdtemp(prefix=f"readme_{package}_"))
    with session.chdir(work):
        if package == "tilestack":
            session.run("tilestack", "doctor", env=env)
        else:
            session.run("python", "-m", "tilehal", "doctor", env=env)
            readme = ROOT / "packages" / PACKAGES[package] / "README.md"
            session.run("python", str(ROOT / "scripts" / "run_readme_example.py"), str(readme), env=env)
        if package == "kvpool":  # the top-level README's example installs tilestack-kvpool
            session.run("python", str(ROOT / "scripts" / "run_readme_example.py"), str(ROOT / "README.md"), env=env)
    shutil.rmtree(work, ignore_errors=True)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """GPU tests with the interpreter at hand (the GPU machine has torch+CUDA and nothing to install)."""
    paths = [f"packages/{f}/tests" for f in PACKAGES.values()] + ["tests"]
    session.run("python", "-m", "pytest", "-m", "gpu or multi_gpu", "-q", *paths, *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: environment report, then the end-to-end demo on the CPU."""
    _install_everything(session)
    session.run("tilestack", "doctor")
    session.run("tilestack", "demo")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The CPU benchmark suite; with `-- --record` it writes tables and JSON under docs/benchmarks/."""
    _install(session, *CONSTRAINTS, "-e", "packages/hal[torch,cuda,test]",
             *[a for f in list(PACKAGES.values())[1:] for a in ("-e", f"packages/{f}[test,bench]")], "-e", ".[hf,bench]")
    session.run("tilestack", "bench", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Run every README's Python example and check each package has its guide page and working links."""
    _install_everything(session)
    session.run("python", "scripts/check_docs.py")

