"""The PyTorch Lightning recipe (``docs/examples/integrations/lightning_train.py``, Lightning
2.6) as a user runs it: the script on 2 gloo ranks, which Lightning starts itself. The checks
are the script's: the loss falls, ``gradient_clip_val`` clips every gradient (dmuon's Muon
gradients too) by one norm, and a run resumed from the first epoch's checkpoint in a module
built from other weights repeats the uninterrupted run's losses bit for bit, and
``trainer.validate(..., ckpt_path=...)`` scores the trained module's loss. Skipped where
Lightning is not installed (CI does not install it; ``nox -s integrations`` runs the script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

EXAMPLE = Path(__file__).resolve().parents[3] / "docs/examples/integrations/lightning_train.py"


@pytest.mark.distributed
def test_lightning_recipe_clips_every_gradient_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the clip took every gradient's norm" in done.stdout, done.stdout[-3000:]
    assert "as the trained module" in done.stdout, done.stdout[-3000:]
