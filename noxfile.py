"""Every dev task of the monorepo: `nox -l` lists them.

The README's two commands are `nox -s demo` (the main job) and `nox -s lint tests isolation`
(all tests). GPU tests run on the GPU machine with `nox -s gpu`, or without nox as
../shared/GPU.md describes (scripts/device_env.sh + pytest -m gpu).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests", "isolation"]
nox.options.reuse_existing_virtualenvs = False
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"
CONSTRAINTS = ("-c", "constraints.txt")
# Import name -> folder; order is the layering (tilehal first).
PACKAGES = {"tilehal": "hal", "tilelang": "tilelang", "deepgemm": "deepgemm", "deepep": "deepep",
            "kvpool": "kvpool", "dataengine": "dataengine"}
CPU_MARKERS = "not gpu and not multi_gpu and not slow"
# Every nox test run replays the same hypothesis examples (root conftest.py's "ci" profile).
TEST_ENV = {"HYPOTHESIS_PROFILE": "ci"}


def _install_everything(session: nox.Session) -> None:
    editable = ["-e", "packages/hal[torch,cuda,test]"]
    for folder in list(PACKAGES.values())[1:]:
        editable += ["-e", f"packages/{folder}[test]"]
    session.install(*CONSTRAINTS, *editable, "-e", ".[hf]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All CPU tests of every package and the cross-package tests, in one environment."""
    _install_everything(session)
    paths = [f"packages/{f}/tests" for f in PACKAGES.values()] + ["tests"]
    session.run("pytest", "-n", "2", "--dist", "loadfile", "-m", CPU_MARKERS, "-q", *paths, *session.posargs,
                env=TEST_ENV)


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES))
def isolation(session: nox.Session, package: str) -> None:
    """A fresh environment with only `package` and tilehal: it installs alone and its tests pass."""
    folder = PACKAGES[package]
    if package == "tilehal":
        session.install(*CONSTRAINTS, "packages/hal[test]")
        # tilehal alone must not pull torch in.
        session.run("python", "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)")
    else:
        session.install(*CONSTRAINTS, "packages/hal[cuda]", f"packages/{folder}[test]")
    session.run("python", "-c", f"import {package}; print({package}.__name__, {package}.__version__)")
    session.run("pytest", "-n", "2", "--dist", "loadfile", "-m", CPU_MARKERS, "-q", f"packages/{folder}/tests",
                *session.posargs, env=TEST_ENV)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


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
    """The CPU benchmark suite; writes tables and JSON under docs/benchmarks/."""
    _install_everything(session)
    session.run("tilestack", "bench", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Run every README's Python example and check each package has its guide page."""
    _install_everything(session)
    session.run("python", "scripts/check_docs.py")
