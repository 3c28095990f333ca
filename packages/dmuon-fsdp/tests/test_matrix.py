"""``MatrixView``: the one rule for what Muon steps, and the only module that applies it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import dmuon_fsdp
from dmuon_fsdp._matrix import Glu, LrScaling, MatrixView, matrices_of, matrix_shape

PACKAGE = Path(dmuon_fsdp.__file__).parent


def test_a_2d_weight_is_a_stack_of_one() -> None:
    view = MatrixView.of((64, 256))
    assert (view.batch, view.rows, view.cols) == (1, 64, 256)
    assert view.stack_shape == (1, 64, 256) and view.matrix_shape == (64, 256)
    assert view.lr_scale(LrScaling.MOONLIGHT) == pytest.approx(0.2 * 16)
    assert view.lr_scale("original") == 1.0
    assert MatrixView.of((256, 64)).lr_scale("original") == pytest.approx(2.0)


def test_the_view_names_the_parameter_it_refuses() -> None:
    with pytest.raises(ValueError, match=r"'layers\.0\.conv\.weight' \(shape \(2, 4, 8, 16\)\)"):
        MatrixView.of((2, 4, 8, 16), "layers.0.conv.weight")
    with pytest.raises(ValueError, match="2-D shape"):
        MatrixView.of((16,))


def test_matrices_of_are_views() -> None:
    w = torch.zeros(8, 16)
    assert matrices_of(w)[0] is w
    stack = torch.zeros(3, 8, 16)
    parts = matrices_of(stack)
    assert len(parts) == 3 and all(p.shape == (8, 16) for p in parts)
    parts[1].fill_(1.0)  # writes reach the stack
    assert stack[1].sum() == 128 and stack[0].sum() == 0
    assert matrix_shape(stack.shape) == (8, 16)


def _of_a_mesh(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and "mesh" in ast.unparse(node.value)


# What reads a tensor's number of dimensions or its last two dims as a matrix (a device mesh's
# number of dimensions is another matter).
def _shape_rules(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            (isinstance(part, ast.Attribute) and part.attr == "ndim")
            or (
                isinstance(part, ast.Call)
                and isinstance(part.func, ast.Attribute)
                and part.func.attr == "dim"
            )
            for part in [node.left, *node.comparators]
            if not _of_a_mesh(part)
        ):
            if any(isinstance(c, ast.Constant) and c.value == 2 for c in node.comparators):
                lines.append(node.lineno)
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Slice)
            and isinstance(node.slice.lower, ast.UnaryOp)
            and isinstance(node.slice.lower.operand, ast.Constant)
            and node.slice.lower.operand.value == 2
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_matrix_module_knows_what_a_matrix_is() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "_matrix.py":
            assert _shape_rules(ast.parse(path.read_text())), "the rule itself is not found"
            continue
        if lines := _shape_rules(ast.parse(path.read_text())):
            offenders[module] = lines
    assert not offenders, f"shape rules outside _matrix.py: {offenders}"


def test_an_expert_stack_is_one_matrix_per_expert() -> None:
    view = MatrixView.of((4, 8, 16), "w1")
    assert (view.batch, view.matrix_shape, view.experts) == (4, (8, 16), 4)
    stack = torch.arange(4 * 8 * 16.0).view(4, 8, 16)
    assert [torch.equal(m, stack[e]) for e, m in enumerate(view.matrices(stack))] == [True] * 4
    assert view.count((1, 8, 16)) == 1 and view.count((0, 8, 16)) == 0  # a rank's shard


def test_fused_glu_stacks_split_gate_and_up() -> None:
    # Hugging Face's concatenated gate_up_proj (E, 2I, H): rows [gate; up] of each expert.
    concat = MatrixView.of((3, 2 * 4, 6), "gate_up_proj", glu=Glu.CONCAT)
    assert (concat.batch, concat.matrix_shape) == (6, (4, 6))
    w = torch.randn(3, 8, 6)
    expected = [half for e in range(3) for half in w[e].chunk(2, dim=0)]
    got = concat.matrices(w)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # GPT-OSS's interleaved, transposed (E, H, 2I): gate [..., ::2], up [..., 1::2].
    inter = MatrixView.of((3, 6, 2 * 4), "gate_up_proj", glu=Glu.INTERLEAVED, transposed=True)
    assert (inter.batch, inter.matrix_shape) == (6, (6, 4))
    w = torch.randn(3, 6, 8)
    got = inter.matrices(w)
    expected = [w[e][..., h::2] for h in (0, 1) for e in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    got[0].zero_()  # views: writes reach the parameter
    assert w[0][..., ::2].abs().sum() == 0 and w[0][..., 1::2].abs().sum() > 0
    # The learning-rate scale of a transposed stack follows the logical (out, in).
    assert MatrixView.of((2, 6, 4), transposed=True).lr_scale("original") == 1.0
    assert MatrixView.of((2, 4, 6), transposed=True).lr_scale("original") == pytest.approx(1.5**0.5)
    with pytest.raises(ValueError, match="odd"):
        MatrixView.of((3, 7, 6), "gate_up_proj", glu=Glu.CONCAT)
