"""Sessions for the dmuon workspace: one test session per package, lint, types, isolation, the
docs site, an install smoke test, the demo.

nox                                  # everything CI runs
nox -s "tests(package='dmuon-ns')"   # one package's tests
nox -s docs                          # build the docs site (warnings are errors) and check it
nox -s smoke                         # install as a user would, train 2 ranks, checkpoint
nox -s root                          # `pytest` at the root, the `uv run pytest` route
nox -s extended                      # the slow tests CI leaves out (marked extended)
nox -s demo -- --steps 20            # the main job (extra args go to dmuon-demo)
nox -s integrations                  # training frameworks' recipes on 2 gloo ranks

Every tool version comes from the dependency groups of pyproject.toml, torch's and Triton's from
its ``[tool.uv]`` table: the same pins serve nox, ``uv sync`` and CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")


def _group(name: str) -> list[str]:
    return list(nox.project.dependency_groups(PYPROJECT, name))


def _uv_pin(name: str, key: str) -> str:
    for requirement in PYPROJECT["tool"]["uv"][key]:
        if requirement.replace(" ", "").startswith(f"{name}=="):
            return str(requirement)
    raise SystemExit(f"pyproject.toml: [tool.uv] {key} must pin {name}==X.Y.Z")


def _check_tools_txt() -> None:
    """.ci/run installs nox and uv with pip from tools.txt (pip cannot read dependency groups):
    it must say what the `tools` group says."""
    lines = (ROOT / "tools.txt").read_text().splitlines()
    listed = sorted(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    if listed != sorted(_group("tools")):
        raise SystemExit(
            f"tools.txt lists {listed} but pyproject.toml's `tools` group pins "
            f"{sorted(_group('tools'))}: make them equal"
        )


_check_tools_txt()
# What CI installs is pinned so that it never follows a moving release. The code itself also
# runs on torch 2.11 (the GPU machine's version).
TORCH = _uv_pin("torch", "constraint-dependencies")
TRITON = _uv_pin("triton", "override-dependencies")
TEST_TOOLS = _group("test")

# Internal dependencies: they point one way only (a package never imports a sibling it does
# not list here; the isolation session checks it).
PACKAGES: dict[str, list[str]] = {
    "dmuon-ns": [],
    "dmuon-ownership": [],
    "dmuon-clip": [],
    "dmuon-fsdp": ["dmuon-ns", "dmuon-ownership"],
    "dmuon": ["dmuon-ns", "dmuon-ownership", "dmuon-clip", "dmuon-fsdp"],
}
NEEDS_TORCH = {"dmuon-ns", "dmuon-clip", "dmuon-fsdp", "dmuon"}
# Packages whose tests run Triton kernels in the interpreter (TRITON_INTERPRET=1) on CPU.
NEEDS_TRITON = {"dmuon-ns", "dmuon-clip", "dmuon-fsdp", "dmuon"}
# What one package's tests need beyond TEST_TOOLS (dmuon-fsdp: the Hugging Face export test;
# dmuon: the planner's shapes against transformers' models, and the Trainer integration,
# dmuon.integrations.hf).
TEST_EXTRAS: dict[str, list[str]] = {
    "dmuon-fsdp": _group("test-hf"),
    "dmuon": _group("test-hf"),
}

nox.options.default_venv_backend = "uv"
nox.options.sessions = [
    "lint",
    "isolation",
    "typecheck",
    "docs",
    "smoke",
    "integrations",
    "root",
    "tests",
]
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

# uv installs without compiling bytecode, so a Python told not to write any
# (PYTHONDONTWRITEBYTECODE, set on some CI machines) compiles torch's thousands of modules from
# source in every process it starts: each gloo rank, each demo run. The tests start dozens, and
# on two cores that doubled a suite's time. Python's default (write the cache on first import,
# into the session's venv and the gitignored __pycache__ folders) pays it once per session.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _editable(*names: str) -> list[str]:
    args: list[str] = []
    for name in names:
        args += ["-e", str(ROOT / "packages" / name)]
    return args


def _closure(package: str) -> list[str]:
    return [*PACKAGES[package], package]


def _test_deps(package: str) -> list[str]:
    deps = [*TEST_TOOLS, *TEST_EXTRAS.get(package, [])]
    if package in NEEDS_TORCH:
        deps.append(TORCH)
    if package in NEEDS_TRITON:
        deps.append(TRITON)
    return deps


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """pytest for one package, CPU only (gloo for distributed tests, Triton in the interpreter),
    without the GPU tests and the extended ones (``nox -s extended``)."""
    session.install(*_test_deps(package), *_editable(*_closure(package)))
    session.chdir(ROOT / "packages" / package)
    session.run("pytest", "-m", "not gpu and not extended", "-q", *session.posargs)


# pytest's exit status when no test was selected: a package without extended tests.
NO_TESTS_COLLECTED = 5


@nox.session
def extended(session: nox.Session) -> None:
    """The tests marked ``extended`` in every package, CPU only: slow ones (eight gloo ranks,
    torch.compile under tensor parallelism or on one rank, the rest of a few option matrices)
    whose parts faster tests in the ``tests`` sessions cover, left out of CI for its time."""
    deps = {dep for package in PACKAGES for dep in _test_deps(package)}
    session.install(*sorted(deps), *_editable(*PACKAGES))
    for package in PACKAGES:
        session.chdir(ROOT / "packages" / package)
        session.run(
            "pytest", "-m", "extended and not gpu", "-q", *session.posargs,
            success_codes=[0, NO_TESTS_COLLECTED],
        )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole workspace."""
    session.install(*_group("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's src/, then, under ``--strict`` as a user's project would run it,
    the typing checks of the public API (packages/dmuon/tests/typecheck: ``assert_type`` lines,
    never run)."""
    session.install(*_group("typecheck"), TORCH, *_editable(*PACKAGES))
    session.run("mypy", *[str(ROOT / "packages" / p / "src") for p in PACKAGES])
    session.run("mypy", "--strict", str(ROOT / "packages" / "dmuon" / "tests" / "typecheck"))


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


# The documented install from a checkout (README.md, docs/quickstart.md): one pip command.
INSTALL_ORDER = ["dmuon-ns", "dmuon-ownership", "dmuon-clip", "dmuon-fsdp", "dmuon"]
# Present in every test session, so a runtime import of one would pass there unnoticed.
NOT_RUNTIME = ["pytest", "hypothesis"]
# Runtime dependencies that the test tools also bring: the clean install must have them from
# the packages' own metadata (numpy: dmuon-fsdp's checkpoints, through torch's DCP).
RUNTIME = ["numpy"]
EXAMPLES = ROOT / "docs" / "examples"


@nox.session(venv_backend="none")
def smoke(session: nox.Session) -> None:
    """Install as a user would, into a clean venv without test tools: pinned torch, then the
    five packages with the one documented pip command; then, through the public `dmuon` API on
    2 gloo ranks, train (docs/examples/train_fsdp.py: 3 steps, the loss must be finite and
    fall) and round-trip a sharded checkpoint (docs/examples/checkpoint_fsdp.py: the run resumed
    from `save_checkpoint` / `load_checkpoint` must repeat the uninterrupted one's losses)."""
    with tempfile.TemporaryDirectory() as venv:
        session.run(sys.executable, "-m", "venv", venv, external=True)
        python = str(Path(venv) / "bin" / "python")
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        # torch without pip's bytecode pass over its thousands of modules (30 s on two cores),
        # most of which the examples never import: Python caches the ones they do.
        session.run(*pip, "--no-compile", TORCH, external=True)
        session.chdir(ROOT)
        session.run(*pip, *[f"./packages/{name}" for name in INSTALL_ORDER], external=True)
        clean = (
            "import importlib.util, sys; "
            f"present = [m for m in {NOT_RUNTIME!r} if importlib.util.find_spec(m)]; "
            f"missing = [m for m in {RUNTIME!r} if not importlib.util.find_spec(m)]; "
            "sys.exit(f'not a clean user install: {present} present, {missing} missing' "
            "if present or missing else 0)"
        )
        session.run(python, "-c", clean, external=True)
        session.run(python, str(EXAMPLES / "train_fsdp.py"), external=True)
        session.run(python, str(EXAMPLES / "checkpoint_fsdp.py"), external=True)


ROOT_SUITE = "dmuon-ownership"


@nox.session
def root(session: nox.Session) -> None:
    """`pytest` at the repository root, as the README's `uv run pytest` runs it, at a cost CI
    can pay (under a minute on two cores). First the lockfile must match every pyproject.toml
    (`uv lock --check`, offline): what `uv sync` installs is what the packages declare. Then the
    root run with one package suite, dmuon-ownership's (pure Python, seconds, so the session
    installs only it and the test tools), and the root's own tests (testing/; docs/tests, the
    other test path, is the docs session's). That
    exercises everything the route adds to the `tests` sessions (the root configuration, each
    suite in its own process with its output streamed under the package's name, the
    per-package report and its total) without running the suites a second time: the whole
    route takes as long as every `tests` session together (11 minutes on two cores), which
    CI's 20 minutes cannot hold twice. The `uv sync` environment itself (PyPI's CUDA torch on
    Linux, several GB) is left to the README's command; there the GPU tests skip without a
    CUDA device."""
    session.run("uv", "lock", "--check", "--offline", external=True)
    session.install(*TEST_TOOLS, *_editable(*_closure(ROOT_SUITE)))
    session.chdir(ROOT)
    # testing/ alone: docs/tests, the root's other test path, is the docs session's to run.
    only = ["testing", "-k", f"not test_package_suite or {ROOT_SUITE}"]
    session.run("pytest", *only, *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site with warnings as errors (docs/_build/html), then check that it covers
    every public name and every error message, and that the pages' snippets define what they
    use (the tuning, clipping, EMA, checkpoint and TP pages' run on gloo ranks) (docs/tests)."""
    session.install(*_group("docs"), *TEST_TOOLS, TORCH, *_editable(*PACKAGES))
    out = ROOT / "docs" / "_build" / "html"
    session.run("sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out))
    session.run("pytest", "-q", str(ROOT / "docs" / "tests"))
    session.log(f"docs: {out / 'index.html'}")


# Training frameworks whose recipes docs/guides/integrations/ shows, each pinned, and the
# example that runs it (docs/examples/integrations/): 10 steps on 2 gloo ranks, a save, a resume
# in a model built from other weights; the script exits non-zero unless the loss fell and the
# resumed losses equal the uninterrupted run's bit for bit.
INTEGRATIONS: dict[str, list[str]] = {
    "lightning_train.py": ["lightning==2.6.6"],
    "hf_trainer_train.py": ["transformers==5.24.0", "accelerate==1.16.0"],
    "accelerate_train.py": ["transformers==5.24.0", "accelerate==1.16.0"],
    # torchtitan 0.3 imports Triton at import time (its expert-parallel kernels).
    "torchtitan_train.py": ["torchtitan==0.3.0", TRITON],
}
# A recipe's further runs, each with its own arguments and checks (one run without by default).
INTEGRATION_ARGS: dict[str, list[list[str]]] = {
    # and in 2 pipeline stages, one per rank and two per rank (a V schedule: MuonParts and the
    # split backward)
    "torchtitan_train.py": [[], ["--pp", "2"], ["--pp", "2", "--schedule", "ZBVZeroBubble"]],
}


@nox.session
def integrations(session: nox.Session) -> None:
    """Each framework recipe's example on 2 gloo ranks, after installing the framework at its
    pinned version and the five packages; in CI since a framework's release or a change of
    dmuon's can break a recipe that no package test runs."""
    frameworks = sorted({pin for pins in INTEGRATIONS.values() for pin in pins})
    session.install(TORCH, *frameworks, *_editable(*INSTALL_ORDER))
    session.chdir(ROOT)
    for script in INTEGRATIONS:
        for args in INTEGRATION_ARGS.get(script, [[]]):
            session.run("python", str(EXAMPLES / "integrations" / script), *args)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: dmuon vs FSDP2 + AdamW on 4 local CPU ranks (args after -- go to the demo)."""
    session.install(TORCH, *_group("demo"), *_editable(*PACKAGES))
    session.run("dmuon-demo", *session.posargs)
