"""The Python snippets of the docs pages run as written.

Each package's README is read by someone who installed that package alone: its snippets import
only that package and what its ``pyproject.toml`` declares, and every name they take from a
dmuon package exists there.

Every ```` ```python ```` block of the concepts page, the quickstart, the FAQ and the guides
(the training frameworks' pages included) parses, and uses only names that it binds, that an
earlier block of its page binds (or a function the page shows from an example file), or that
the guides' setup binds (``docs/examples/guide_setup.py`` and "the usual wrap" on
``docs/guides/index.md``): a reader who pastes the setup and a page's snippets in order meets
no ``NameError``. The tuning page's snippets also run, after the setup, as one script on one
gloo rank, the clipping page's after the usual wrap on one, the EMA and checkpoint pages' after
the usual wrap on two, and the TP page's first
on two (one TP group, whose ranks must read one batch).
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
SETUP = DOCS / "examples" / "guide_setup.py"
INDEX = DOCS / "guides" / "index.md"
PAGES = [
    DOCS / "concepts.md",
    DOCS / "quickstart.md",
    DOCS / "faq.md",
    *sorted((DOCS / "guides").rglob("*.md")),
]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
# A function or class a page shows from an example file (```{literalinclude} ... :pyobject: NAME).
SHOWN = re.compile(r"^```\{literalinclude\}[^\n]*\n(?::[^\n]*\n)*?:pyobject: (\w+)$", re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def bound_and_used(source: str) -> tuple[set[str], set[str]]:
    """The names a block binds anywhere in it (assignments, imports, definitions, loop and
    ``with`` targets, parameters, ``except`` names) and the names it reads."""
    bound: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used


def module_level_names(source: str) -> set[str]:
    """The names ``source`` binds at module level: those of its functions and classes, not the
    parameters and locals inside them (a snippet cannot read those)."""
    bound: set[str] = set()
    pending: list[ast.AST] = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        pending.extend(ast.iter_child_nodes(node))
    return bound


def setup_names() -> set[str]:
    names = set(dir(builtins)) | module_level_names(SETUP.read_text(encoding="utf-8"))
    for block in python_blocks(INDEX):
        names |= bound_and_used(block)[0]
    return names


def test_the_pages_have_snippets_and_the_setup_binds_the_model() -> None:
    # Guards the scanner: no blocks, or a setup without a model, would pass vacuously.
    assert sum(len(python_blocks(page)) for page in PAGES) > 25
    assert {"model", "mesh", "predicate", "loss_fn", "loader", "optimizer"} <= setup_names()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_snippet_uses_only_names_it_or_the_setup_defines(page: Path) -> None:
    # A function the page shows from its example (build_model) counts as defined there.
    known = setup_names() | set(SHOWN.findall(page.read_text(encoding="utf-8")))
    for number, block in enumerate(python_blocks(page), 1):
        try:
            bound, used = bound_and_used(block)
        except SyntaxError as err:
            pytest.fail(f"{page.name}, python block {number} does not parse: {err}\n{block}")
        undefined = sorted(used - bound - known)
        assert not undefined, (
            f"{page.name}, python block {number} uses {undefined}, which neither it, an earlier"
            f" block of the page nor the guides' setup defines: define or import them\n{block}"
        )
        known |= bound


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_after_the_setup(tmp_path: Path, blocks: list[str], ranks: int = 1) -> str:
    """Run the setup and ``blocks`` as one script on ``ranks`` gloo ranks (``torchrun``
    beyond one); its output."""
    script = tmp_path / "page.py"
    parts = [SETUP.read_text(encoding="utf-8"), *blocks]
    # The ending the FAQ gives for a gloo run whose exit status matters: leave each rank
    # without the interpreter's shutdown, where gloo may abort (pytorch/pytorch#190489).
    ending = "import sys\ndist.destroy_process_group()\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"
    script.write_text("\n\n".join([*parts, ending]), encoding="utf-8")
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "CUDA_VISIBLE_DEVICES": "",  # the CPU path, as CI runs it
        "OMP_NUM_THREADS": "1",
    }
    launch = [sys.executable, str(script)]
    if ranks > 1:
        launch = [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)),
            *("--master-addr", "127.0.0.1", "--master-port", env["MASTER_PORT"], str(script)),
        ]
    done = subprocess.run(
        launch,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    return output


@pytest.mark.distributed
def test_the_ema_page_runs_after_the_usual_wrap(tmp_path: Path) -> None:
    blocks = [*python_blocks(INDEX), *python_blocks(DOCS / "guides" / "ema.md")]
    # Two ranks: a snippet that ran a forward on one rank only would hang here.
    output = _run_after_the_setup(tmp_path, blocks, ranks=2)
    assert output.count("EMA loss") == 4, output[-8000:]


@pytest.mark.distributed
def test_the_tuning_page_runs_after_the_setup(tmp_path: Path) -> None:
    output = _run_after_the_setup(tmp_path, python_blocks(DOCS / "guides" / "tuning.md"))
    # The logging advice shows the owner plan; the groups are the ones the page names.
    assert "dedicate_params: 14 params assigned to 1 ranks" in output, output[-8000:]
    assert "['base/muon', 'base/adamw', 'io/muon', 'io/adamw']" in output
    assert "step 4 loss" in output and "'muon_update'" in output
    # The port from torch.optim.Muon ran its warm-up to the end, on the Muon group only.
    assert "momentum [0.95]" in output, output[-8000:]
    # ... and a torch.optim.Muon + AdamW run carried over mid-way, its momentum rescaled.
    assert "carried over True" in output, output[-8000:]


@pytest.mark.distributed
def test_the_clipping_page_runs_after_the_usual_wrap(tmp_path: Path) -> None:
    # The page's loop follows the wrap's, as a reader pastes it: its clip runs between a
    # backward and a step of its own.
    blocks = [*python_blocks(INDEX), *python_blocks(DOCS / "guides" / "clipping.md")]
    ending = "print('clip stats', stats.param_count, bool(stats.found_inf))\n"
    output = _run_after_the_setup(tmp_path, [*blocks, ending])
    assert "clip stats 14 False" in output, output[-8000:]


# Modules a README snippet may need installed; the standard library is always there.
INSTALLED_MODULES = {"dmuon", "dmuon_ns", "dmuon_ownership", "dmuon_clip", "dmuon_fsdp"}
INSTALLED_MODULES |= {"torch", "numpy", "triton", "transformers"}
READMES = sorted(ROOT.glob("packages/*/README.md"))


def declared_modules(package: Path) -> set[str]:
    """The modules of the package at ``package`` and of what its pyproject declares (its
    dependencies and extras), as importable names."""
    meta = tomllib.loads((package / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = [d for group in meta.get("optional-dependencies", {}).values() for d in group]
    names = [meta["name"], *meta.get("dependencies", []), *extras]
    return {re.split(r"[\s<>=!~\[;]", n, maxsplit=1)[0].replace("-", "_") for n in names}


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _resolves(dotted: str) -> bool:
    import importlib

    root, *attrs = dotted.split(".")
    obj: object = importlib.import_module(root)
    path = root
    for attr in attrs:
        path = f"{path}.{attr}"
        if not hasattr(obj, attr):
            try:
                obj = importlib.import_module(path)
            except ImportError:
                return False
            continue
        obj = getattr(obj, attr)
    return True


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_a_package_readme_uses_only_what_the_package_declares(readme: Path) -> None:
    declared = declared_modules(readme.parent)
    for number, block in enumerate(python_blocks(readme), 1):
        tree = ast.parse(block)
        needed: set[str] = set()
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                needed |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                needed.add(node.module.split(".")[0])
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                needed.add(node.id)
            elif isinstance(node, ast.Attribute) and (dotted := _dotted(node)):
                names.add(dotted)
        missing = sorted((needed & INSTALLED_MODULES) - declared)
        assert not missing, (
            f"{readme.relative_to(ROOT)}, python block {number} uses {missing}, which"
            f" {readme.parent.name} does not declare: a reader who installed it alone has not"
            f" got them\n{block}"
        )
        ours = declared & {"dmuon", "dmuon_ns", "dmuon_ownership", "dmuon_clip", "dmuon_fsdp"}
        absent = sorted(n for n in names if n.split(".")[0] in ours and not _resolves(n))
        assert not absent, f"{readme.relative_to(ROOT)}, python block {number}: no {absent}"


@pytest.mark.distributed
def test_the_tp_page_gives_each_tp_group_one_batch(tmp_path: Path) -> None:
    # Two ranks, one TP group: its ranks must compute on the same batch, so their losses
    # agree bit for bit (fed the setup's per-rank loader, they would differ).
    loop = (
        "for inputs, targets in loader[:2]:\n"
        "    optimizer.zero_grad()\n"
        "    loss = loss_fn(model(inputs), targets)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "losses = [None, None]\n"
        "dist.all_gather_object(losses, loss.item())\n"
        "if dist.get_rank() == 0:\n"
        "    print(f'TP losses {losses[0]!r} {losses[1]!r}')\n"
    )
    blocks = [python_blocks(DOCS / "guides" / "tp.md")[0], loop]
    output = _run_after_the_setup(tmp_path, blocks, ranks=2)
    found = re.findall(r"TP losses (\S+) (\S+)\n", output)
    assert len(found) == 1 and found[0][0] == found[0][1], output[-8000:]


@pytest.mark.distributed
def test_the_checkpoint_page_runs_after_the_usual_wrap(tmp_path: Path) -> None:
    # Two ranks: every rank reads the files rank 0 writes. The Hugging Face blocks (a
    # pretrained model's files, a transformers model) are left out.
    page = python_blocks(DOCS / "guides" / "checkpoints.md")
    blocks = [*python_blocks(INDEX), *[b for b in page if "transformers" not in b]]
    assert len(blocks) == len(python_blocks(INDEX)) + 8
    # The page's export of the async save (nothing trained since) holds the model's weights,
    # and so do the plain model read in one process and the model that went through a plain
    # FSDP2 model's checkpoint and back.
    ending = (
        "dist.barrier()\n"
        "export = full if dist.get_rank() == 0 else None\n"
        "ckpt_sd = dmuon.get_model_state_dict(model)\n"
        "if dist.get_rank() == 0:\n"
        "    print('resumed at step', step)\n"
        "    same = export.keys() == ckpt_sd.keys() and all(\n"
        "        torch.equal(export[k], v) for k, v in ckpt_sd.items()\n"
        "    )\n"
        "    local_sd = local.state_dict()\n"
        "    same = same and all(torch.equal(export[k], v) for k, v in local_sd.items())\n"
        "    print('export equal', same, len(export))\n"
    )
    output = _run_after_the_setup(tmp_path, [*blocks, ending], ranks=2)
    assert output.count("resumed at step 100") == 1, output[-8000:]
    assert re.search(r"export equal True [1-9]", output), output[-8000:]
