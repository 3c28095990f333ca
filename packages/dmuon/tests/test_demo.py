"""``dmuon-demo`` end to end on gloo ranks (tiny sizes), and its argument errors."""

from __future__ import annotations

import importlib.util
import io
import math
import re
from pathlib import Path

import pytest
import torch

from dmuon._demo import main

TINY = ["--hidden", "32", "--intermediate", "64", "--layers", "2", "--heads", "2"]
TINY += ["--vocab", "64", "--seq-len", "16", "--batch-size", "8", "--lr", "0.05"]
_STEP = re.compile(r"^step\s+(\d+)/(\d+)\s+(adamw|dmuon) loss (\S+)\s+(\S+) s/it$")


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    assert main(argv, out=out) == 0
    return out.getvalue()


def _losses(text: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"adamw": [], "dmuon": []}
    for line in text.splitlines():
        if m := _STEP.match(line):
            found[m.group(3)].append(float(m.group(4)))
    return found


@pytest.mark.distributed
def test_demo_runs_both_and_prints_the_table() -> None:
    text = _run(["--steps", "3", "--nproc", "2", *TINY])
    losses = _losses(text)
    for run in ("adamw", "dmuon"):
        assert len(losses[run]) == 3, text
        assert all(math.isfinite(x) for x in losses[run])
        assert losses[run][-1] < losses[run][0], f"{run} loss did not fall: {losses[run]}"
    # Same initial weights and data: the first forward is identical before any update.
    assert losses["adamw"][0] == losses["dmuon"][0]
    # dmuon's owner-plan summary is forwarded from rank 0.
    assert "dedicate_params: 14 params assigned to 2 ranks" in text
    table = text[text.index("run  ") :]
    assert "FSDP2 + AdamW" in table and "dmuon (Muon + AdamW)" in table
    assert "SPEC §1 formula" in table
    # Z3 on a 1-D mesh: two broadcast rounds and one reduce round, each carrying P_M
    # (SPEC section 1), counted from the collectives dmuon issued.
    rounds = float(re.search(r"counted: shard (\S+)·P_M", table).group(1))
    assert rounds == pytest.approx(3.0, rel=0.01)


@pytest.mark.distributed
def test_demo_hsdp_z2_with_plot(tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    argv = ["--steps", "2", "--nproc", "2", "--replicate", "2", "--zero", "2", "--only", "dmuon"]
    # matplotlib is an optional extra (dmuon[demo]); without it only the plot is left out.
    with_plot = importlib.util.find_spec("matplotlib") is not None
    text = _run([*argv, *(["--plot", str(plot)] if with_plot else []), *TINY])
    assert "mesh (2, 1) ('replicate', 'shard'), Z2" in text
    assert len(_losses(text)["dmuon"]) == 2 and not _losses(text)["adamw"]
    # HSDP adds one reduce and one publish round on the replicate axis (G = 1 here).
    m = re.search(r"counted: shard (\S+)·P_M, replicate (\S+)·P_M", text)
    assert m is not None, text
    assert float(m.group(2)) == pytest.approx(2.0, rel=0.01)
    if with_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "3", "--replicate", "2"], "--replicate 2 must divide the number of ranks"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--zero", "1"], "--zero must be 2 or 3"),
        (["--nproc", "4", "--batch-size", "6"], "--batch-size 6 must be divisible"),
        (["--plot", "loss.pdf"], "--plot needs a .png"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--hidden", "30"], "divisible by heads"),
    ],
)
def test_bad_options_exit_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpus_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--device", "cuda", "--nproc", "2"])
    assert "--device cuda needs one GPU per rank" in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_training(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with pytest.raises(SystemExit):
        main(["--plot", "loss.png"])
    assert "pip install 'dmuon[demo]'" in capsys.readouterr().err
