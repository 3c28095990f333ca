"""``dmuon-demo`` end to end on gloo ranks (tiny sizes), and its argument errors."""

from __future__ import annotations

import importlib.util
import io
import math
import re
from pathlib import Path

import pytest
import torch

from dmuon._demo import _table, main
from dmuon._demo_bytes import Mesh, compare, fsdp_shard_bytes
from dmuon._demo_data import MarkovStream
from dmuon._demo_model import LlamaConfig, TinyLlama, muon_predicate
from dmuon._demo_train import DemoOptions, RunKind, RunResult

# The name of the design document outside the repository, spelled so that this file does not
# cite it itself.
OUTSIDE_DOC = "SP" + "EC"

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
    # The baseline's bytes come from the formula, and the table says so; the demo cites no
    # document outside the repository.
    assert "formula (FSDP2's sharding)" in _rows(table)["FSDP2 + AdamW"], table
    assert OUTSIDE_DOC not in text
    # Z3 on a 1-D mesh: two broadcast rounds and one reduce round, each carrying P_M,
    # counted from the collectives dmuon issued.
    rounds = float(re.search(r"counted: shard (\S+)·P_M", table).group(1))
    assert rounds == pytest.approx(3.0, rel=0.01)
    # FSDP2's three rounds of the same matrices move as many bytes, but for the presence flag
    # dmuon's reduce carries per matrix (14 fp32 flags, half of them over the wire per rank;
    # the table shows 0.01 KiB); plain Muon's four rounds on 2 ranks move a third more, so
    # dmuon moves a quarter fewer. The line says what the column shows.
    cells = _byte_cells(table)
    flags = 14 * 4 / 2
    assert cells["dmuon (Muon + AdamW)"] == pytest.approx(
        cells["FSDP2 + AdamW"] + flags, abs=0.005 * 1024
    ), table
    assert (
        "bytes: dmuon moved as many bytes as FSDP2 + AdamW (run; its bytes by formula) and 25%"
        " fewer bytes than FSDP2 + plain Muon (not run; formula)." in table
    )
    assert re.search(r"^FSDP2 \+ plain Muon\s+not run .* formula .*2 \(every rank\)$", table, re.M)


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
    # G = 1: no shard axis, so nothing to save against plain Muon, and the table says so; no
    # AdamW run, so no comparison with it.
    assert "bytes: dmuon moved as many bytes as FSDP2 + plain Muon (not run; formula)." in text
    assert OUTSIDE_DOC not in text
    if with_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.distributed
def test_demo_tensor_parallel() -> None:
    text = _run(["--steps", "3", "--nproc", "4", "--tp", "2", *TINY])
    assert "mesh (2, 2) ('shard', 'tp'), Z3" in text
    losses = _losses(text)
    for run in ("adamw", "dmuon"):
        assert len(losses[run]) == 3 and losses[run][-1] < losses[run][0], text
    # Both runs shard the projections over 'tp' the same way: same first forward.
    assert losses["adamw"][0] == losses["dmuon"][0]
    # Z3's three rounds move a rank's TP shards only: 3 · P_M / T payload per rank.
    rounds = float(re.search(r"counted: shard (\S+)·P_M, tp NS (\S+)·P_M wire", text).group(1))
    assert rounds == pytest.approx(1.5, rel=0.01)
    assert "1 (its owner's 2 TP ranks)" in text
    # The TP group's NS traffic (gathers and scatters, 0.5·P_M) makes dmuon move more than
    # FSDP2 + AdamW's 3 rounds of P_M/4 chunks, though less than plain Muon's: the line says
    # "more" where the column shows more.
    cells = _byte_cells(text[text.index("run  ") :])
    assert cells["dmuon (Muon + AdamW)"] > cells["FSDP2 + AdamW"]
    assert "dmuon moved 67% more bytes than FSDP2 + AdamW" in text, text
    assert "and 17% fewer bytes than FSDP2 + plain Muon (not run; formula)" in text


@pytest.mark.distributed
def test_demo_moe_steps_experts_where_fsdp2_holds_them() -> None:
    text = _run(["--steps", "3", "--nproc", "2", "--moe", "4", *TINY])
    losses = _losses(text)
    for run in ("adamw", "dmuon"):
        assert len(losses[run]) == 3 and losses[run][-1] < losses[run][0], text
    assert losses["adamw"][0] == losses["dmuon"][0]  # the same model and data
    # dmuon's rounds carry the 2-D matrices only (P_M): the expert stacks move through FSDP2.
    assert "counted: shard 3.00·P_M" in text, text
    assert "the expert stacks, Muon too" in text


@pytest.mark.distributed
def test_demo_qk_clip_holds_the_logits_that_run_away_without_it() -> None:
    # A high learning rate grows the logits; both dmuon runs record each layer's largest one.
    argv = ["--steps", "8", "--nproc", "2", *TINY, "--lr", "0.3", "--qk-clip", "3"]
    text = _run(argv)
    assert "dmuon + QK-clip" in text[text.index("run  ") :]
    report = text[text.index("largest attention logit per layer (QK-clip at τ = 3)") :]
    rows = {}
    for label in ("dmuon (Muon + AdamW)", "dmuon + QK-clip"):
        line = next(line for line in report.splitlines() if line.strip().startswith(label))
        rows[label] = [float(x) for x in re.findall(r"(\d+\.\d+) \(", line)]
    free, clipped = rows["dmuon (Muon + AdamW)"], rows["dmuon + QK-clip"]
    assert len(free) == len(clipped) == 2
    assert min(free) > 3 * 3, free  # run away without the clip
    assert max(clipped) < 2 * 3, clipped  # held near τ with it
    assert len(re.findall(r"^step\s+\d+/8\s+dmuon-qk loss", text, re.M)) == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "3", "--replicate", "2"], "--replicate 2 must divide the number of ranks"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--nproc", "4", "--tp", "3"], "--tp 3 must divide the ranks of one replica (4)"),
        (["--nproc", "2", "--tp", "2", "--heads", "1"], "--tp 2 must divide --heads (1)"),
        (["--nproc", "4", "--tp", "2", "--batch-size", "3"], "data-parallel ranks (2)"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--zero", "1"], "--zero must be 2 or 3"),
        (["--nproc", "4", "--batch-size", "6"], "--batch-size 6 must be divisible"),
        (["--plot", "loss.pdf"], "--plot needs a .png"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--hidden", "30"], "divisible by heads"),
        (["--qk-clip", "0"], "--qk-clip must be > 0"),
        (["--only", "dmuon-qk"], "--only dmuon-qk needs --qk-clip TAU"),
        (["--nproc", "4", "--tp", "2", "--moe", "4"], "--moe with --tp"),
        (["--moe", "-1"], "experts must be >= 0"),
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
    assert "pip install matplotlib" in capsys.readouterr().err


TABLE_MODEL = LlamaConfig(vocab=64, hidden=32, intermediate=64, layers=2, heads=2, seq_len=16)
# The Muon-target matrices of TABLE_MODEL: q, k, v, o (32 x 32), gate, up (64 x 32), down.
TABLE_P_M = 2 * (4 * 32 * 32 + 3 * 64 * 32) * 4  # fp32 bytes


def _fake_results(world: int, shard_pm: float, replicate_pm: float) -> list[list[RunResult]]:
    """Per-rank results as a run of TABLE_MODEL would return them, with dmuon's counted
    payloads in P_M."""
    numel, steps = TABLE_P_M // 4, 3
    out = []
    for _ in range(world):
        adamw = RunResult(RunKind.ADAMW, numel, 4, [4.0, 3.0, 2.0], [0.2, 0.1, 0.1])
        ours = RunResult(
            RunKind.DMUON,
            numel,
            4,
            [4.0, 3.0, 1.5],
            [0.3, 0.2, 0.2],
            shard_bytes=[round(shard_pm * TABLE_P_M)] * steps,
            replicate_bytes=[round(replicate_pm * TABLE_P_M)] * steps,
        )
        out.append([adamw, ours])
    return out


def _rows(table: str) -> dict[str, str]:
    return {line.split("  ")[0]: line for line in table.splitlines()}


def _byte_cells(table: str) -> dict[str, float]:
    """Run label -> the byte column, in bytes, as printed."""
    units = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
    header, _, *rows = table.splitlines()
    start = header.index("Muon bytes/step/rank")
    cells = {}
    for row in rows:
        if "  " not in row or row.startswith(("bytes:", "P_M")):
            break
        number, unit = row[start:].split()[:2]
        cells[row.split("  ")[0]] = float(number) * units[unit]
    return cells


@pytest.mark.parametrize(
    ("replicate", "zero", "shard_pm", "replicate_pm", "adamw", "plain", "plain_pm"),
    [
        # 1-D, 4 ranks. dmuon Z3: 3 rounds x 3/4 = 2.25 P_M, as FSDP2's 3 rounds; plain Muon:
        # 4 x 3/4 = 3 P_M.
        (1, 3, 3.0, 0.0, "as many bytes as", "25% fewer bytes than", 3.0),
        # 1-D Z2: 2 x 3/4 = 1.5 P_M, as FSDP2's 2 rounds, against plain Muon's 3 x 3/4.
        (1, 2, 2.0, 0.0, "as many bytes as", "33% fewer bytes than", 2.25),
        # HSDP (2, 2) Z3: shard 3 x 1/2 + replicate (P_M/G reduce + publish) x 1/2 = 2 P_M;
        # FSDP2 3 x 1/2 + the replicas' all-reduce of 1/G chunks 0.5 = 2 P_M; plain Muon 2.5.
        (2, 3, 3.0, 1.0, "as many bytes as", "20% fewer bytes than", 2.5),
        # HSDP (2, 2) Z2: 1 + 0.5 = 1.5 P_M, as FSDP2's; plain Muon 1.5 + 0.5 = 2 P_M.
        (2, 2, 2.0, 1.0, "as many bytes as", "25% fewer bytes than", 2.0),
        # dmuon counted more than FSDP2 moves (a made-up run): the line says so.
        (1, 3, 4.5, 0.0, "50% more bytes than", "12% more bytes than", 3.0),
    ],
)
def test_table_compares_bytes_as_the_column_shows_them(
    replicate: int,
    zero: int,
    shard_pm: float,
    replicate_pm: float,
    adamw: str,
    plain: str,
    plain_pm: float,
) -> None:
    opts = DemoOptions(model=TABLE_MODEL, steps=3, batch_size=8, replicate=replicate, zero=zero)
    stream = MarkovStream(64, 16, seed=0)
    table = _table(_fake_results(4, shard_pm, replicate_pm), opts, 4, stream, "cpu")
    rows = _rows(table)
    assert "1 (its owner)" in rows["dmuon (Muon + AdamW)"]
    assert (
        "not run" in rows["FSDP2 + plain Muon"] and "4 (every rank)" in rows["FSDP2 + plain Muon"]
    )
    cells = _byte_cells(table)
    assert cells["FSDP2 + plain Muon"] == pytest.approx(plain_pm * TABLE_P_M, rel=1e-3)
    assert (
        f"bytes: dmuon moved {adamw} FSDP2 + AdamW (run; its bytes by formula) and {plain}"
        " FSDP2 + plain Muon (not run; formula)." in table
    ), table
    # Every term of the table is explained below it, and nothing points outside the repository.
    for term in ("P_M = ", f"Z{zero} (this run)", "loads=[...]", "plain Muon all-gathers"):
        assert term in table, term
    assert "computed from FSDP2's sharding" in table
    # The slower dmuon step (0.2 s against 0.1 s) gets its reason on CPU, not on GPU.
    assert "step time on CPU: dmuon's step runs Newton-Schulz" in table
    assert "step time on CPU" not in _table(
        _fake_results(4, shard_pm, replicate_pm), opts, 4, stream, "cuda"
    )
    assert OUTSIDE_DOC not in table


@pytest.mark.parametrize(("shard", "tp"), [(2, 1), (3, 1), (5, 1), (2, 2), (3, 2)])
def test_fsdp_chunks_are_padded_as_fsdp2_pads_them(shard: int, tp: int) -> None:
    # FSDP2 splits each (TP-local) matrix on dim 0 with torch.chunk and pads every chunk to
    # the first one's size; ColwiseParallel splits q/k/v/gate/up by rows, RowwiseParallel o
    # and down by columns.
    with torch.device("meta"):
        named = list(TinyLlama(TABLE_MODEL).named_parameters())
    expected = 0
    for name, param in named:
        if not muon_predicate(name, param):
            continue
        local = torch.empty(param.shape, device="meta")
        if tp > 1:
            rowwise = "o_proj" in name or "down_proj" in name
            local = local.chunk(tp, dim=1 if rowwise else 0)[0]
        expected += local.chunk(shard, dim=0)[0].numel() * 4
    assert fsdp_shard_bytes(TABLE_MODEL, Mesh(shard, 1, tp), 4) == expected
    if 32 % (shard * tp) == 0:  # no padding: the chunks hold P_M / (G T)
        assert expected * shard * tp == TABLE_P_M


def test_compare_words_follow_the_figures() -> None:
    assert compare(75, 100) == "25% fewer bytes than"
    assert compare(167, 100) == "67% more bytes than"
    assert compare(100.2, 100) == "as many bytes as"
    assert compare(0, 0) == "as many bytes as" and compare(5, 0) == "more bytes than"
