"""Sessions for the dmuon workspace: one test session per package, lint, types, isolation, demo.

nox                                  # everything CI runs
nox -s "tests(package='dmuon-ns')"   # one package's tests
nox -s demo -- --steps 20            # the main job (extra args go to dmuon-demo)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# What CI installs is pinned so that it never follows a moving release. The code itself also
# runs on torch 2.11 (the GPU machine's version).
TORCH = "torch==2.13.0"
TRITON = "triton==3.6.0"
TEST_TOOLS = ["pytest==9.2.0", "hypothesis==6.155.2", "numpy==2.4.6"]

# Internal dependencies: they point one way only (SPEC section 2).
PACKAGES: dict[str, list[str]] = {
    "dmuon-ns": [],
    "dmuon-ownership": [],
    "dmuon-clip": [],
    "dmuon-fsdp": ["dmuon-ns", "dmuon-ownership"],
    "dmuon": ["dmuon-ns", "dmuon-ownership", "dmuon-clip", "dmuon-fsdp"],
}
NEEDS_TORCH = {"dmuon-ns", "dmuon-clip", "dmuon-fsdp", "dmuon"}
# Packages whose tests run Triton kernels in the interpreter (TRITON_INTERPRET=1) on CPU.
NEEDS_TRITON = {"dmuon-ns", "dmuon-clip", "dmuon"}
# What one package's tests need beyond TEST_TOOLS (dmuon-fsdp: the Hugging Face export test).
TEST_EXTRAS: dict[str, list[str]] = {
    "dmuon-fsdp": ["transformers==5.24.0", "safetensors==0.8.0"],
}

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "isolation", "typecheck", "tests"]
nox.options.error_on_missing_interpreters = True


def _mirror_pip_find_links() -> None:
    """uv does not read pip's configuration. Where pip is configured with local wheel directories
    (find-links, as on machines that keep the pinned CPU torch wheel on disk), hand them to uv so
    that it installs that wheel instead of downloading a multi-GB CUDA build."""
    if "UV_FIND_LINKS" in os.environ:
        return
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
        check=False,
    )
    links = found.stdout.strip()
    if found.returncode == 0 and links:
        os.environ["UV_FIND_LINKS"] = ",".join(links.split())


_mirror_pip_find_links()


def _editable(*names: str) -> list[str]:
    args: list[str] = []
    for name in names:
        args += ["-e", str(ROOT / "packages" / name)]
    return args


def _closure(package: str) -> list[str]:
    return [*PACKAGES[package], package]


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """pytest for one package, CPU only (gloo for distributed tests, Triton in the interpreter)."""
    deps = [*TEST_TOOLS, *TEST_EXTRAS.get(package, [])]
    if package in NEEDS_TORCH:
        deps.append(TORCH)
    if package in NEEDS_TRITON:
        deps.append(TRITON)
    session.install(*deps, *_editable(*_closure(package)))
    session.chdir(ROOT / "packages" / package)
    session.run("pytest", "-m", "not gpu", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole workspace."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's src/."""
    session.install("mypy==2.4.1", TORCH, *_editable(*PACKAGES))
    session.run("mypy", *[str(ROOT / "packages" / p / "src") for p in PACKAGES])


@nox.session
def isolation(session: nox.Session) -> None:
    """Install each package alone (with only its declared internal dependencies) in a fresh venv
    and import every one of its modules: an import of an undeclared sibling fails here."""
    check = ROOT / "testing" / "import_all.py"
    for package in PACKAGES:
        with tempfile.TemporaryDirectory() as venv:
            session.run("uv", "venv", "-q", venv, external=True)
            python = str(Path(venv) / "bin" / "python")
            deps = [TORCH] if package in NEEDS_TORCH else []
            session.run(
                "uv", "pip", "install", "-q", "--python", python, *deps,
                *_editable(*_closure(package)), external=True,
            )  # fmt: skip
            session.run(python, str(check), package, external=True)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: dmuon vs FSDP2 + AdamW on 4 local CPU ranks (args after -- go to the demo)."""
    session.install(TORCH, "matplotlib==3.10.7", *_editable(*PACKAGES))
    session.run("dmuon-demo", *session.posargs)
