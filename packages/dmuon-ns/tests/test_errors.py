"""Every bad input gets a ValueError that names the problem."""

from __future__ import annotations

import pytest
import torch

from dmuon_ns import NewtonSchulz, gram_newton_schulz_distributed, newton_schulz


@pytest.mark.parametrize(
    ("g", "match"),
    [
        (torch.randn(8), r"G must have at least 2 dims .* got shape \(8,\)"),
        (torch.tensor(1.0), "at least 2 dims"),
        (torch.ones(4, 4, dtype=torch.int64), "real floating dtype .* got torch.int64"),
        (torch.ones(4, 4, dtype=torch.bool), "real floating dtype"),
        (torch.ones(4, 4, dtype=torch.complex64), "real floating dtype .* got torch.complex64"),
        (torch.ones(4, 4).to(torch.float8_e4m3fn), "real floating dtype .* got torch.float8"),
        (torch.ones(0, 4), r"empty matrix of shape \(0, 4\)"),
        (torch.ones(3, 4, 0), r"empty matrix of shape \(3, 4, 0\)"),
        ([[1.0, 2.0]], "must be a torch.Tensor"),
    ],
)
def test_bad_tensors(g, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        newton_schulz(g)


def test_bad_tensor_in_a_list_is_named_by_index() -> None:
    with pytest.raises(ValueError, match=r"G\[1\] must have at least 2 dims"):
        newton_schulz([torch.randn(4, 4), torch.randn(4)])
    with pytest.raises(ValueError, match=r"G\[0\] must have a real floating dtype"):
        NewtonSchulz()([torch.ones(2, 3, dtype=torch.int32)])


def test_a_tensor_that_requires_grad_is_refused_with_grad_on() -> None:
    g = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"G requires grad.*pass G\.detach\(\)"):
        newton_schulz(g)
    with torch.no_grad():
        assert torch.equal(newton_schulz(g), newton_schulz(g.detach()))
    with pytest.raises(ValueError, match="cuda_graphs must be a bool, got 'no'"):
        NewtonSchulz(cuda_graphs="no")  # type: ignore[arg-type]


def test_get_ns_backend_names_a_bad_argument() -> None:
    from dmuon_ns import get_ns_backend

    with pytest.raises(TypeError, match=r"takes a dmuon\.NewtonSchulz \(or None\), got 'gram'"):
        get_ns_backend("gram")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda': this torch sees no CUDA device"):
            get_ns_backend(device="cuda")


def test_empty_batch_is_not_an_error() -> None:
    out = newton_schulz(torch.ones(0, 4, 6))
    assert out.shape == (0, 4, 6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "svd"}, "backend must be 'gram' or 'direct', got 'svd'"),
        ({"kernel": "cublas"}, "unknown NS kernel 'cublas'; known kernels are 'auto', .*'torch'"),
        ({"kernel": 3}, "kernel must be a string"),
        ({"coefficients": [(1.0, 2.0)]}, r"coefficients\[0\] must be a triple"),
        ({"coefficients": [(1.0, 2.0, 3.0), (4.0, 5.0)]}, r"coefficients\[1\] must be a triple"),
        ({"steps": 0}, "steps must be a positive int, got 0"),
        ({"steps": 2.5}, "steps must be a positive int"),
        ({"steps": True}, "steps must be a positive int"),
        (
            {"restart_iterations": [0]},
            r"restart_iterations entries must be ints in \[1, steps - 1\]",
        ),
        ({"restart_iterations": [5]}, r"\[1, 4\]"),
        ({"restart_iterations": [1.5]}, "restart_iterations entries must be ints"),
        ({"restart_iterations": 2}, "restart_iterations must be a sequence"),
        ({"dtype": torch.float64}, "dtype is the iteration dtype and must be torch.float16"),
        ({"dtype": torch.float32, "kernel": "triton"}, "iterates on the 'torch' kernel only"),
        ({"eps": 0.0}, "eps must be a positive finite float"),
        ({"eps": float("nan")}, "eps must be a positive finite float"),
        ({"deterministic": "yes"}, "deterministic must be a bool, got 'yes'"),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NewtonSchulz(**kwargs)
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(4, 8), **kwargs)


def test_default_restart_fits_short_iterations() -> None:
    assert NewtonSchulz(steps=2).restarts == ()
    assert NewtonSchulz(steps=3).restarts == (2,)
    assert NewtonSchulz(restart_iterations=[3, 1, 3]).restarts == (1, 3)


def test_config_is_frozen_and_hashable() -> None:
    ns = NewtonSchulz(coefficients=[[1, 2, 3]], restart_iterations=[1])
    assert ns.coefficients == ((1.0, 2.0, 3.0),)
    assert ns == NewtonSchulz(coefficients=((1.0, 2.0, 3.0),), restart_iterations=(1,))
    assert len({ns, NewtonSchulz(coefficients=[[1, 2, 3]], restart_iterations=[1])}) == 1
    with pytest.raises(AttributeError):
        ns.steps = 3  # type: ignore[misc]


def test_distributed_entry_point_validates_too() -> None:
    with pytest.raises(ValueError, match="x_local must have at least 2 dims"):
        gram_newton_schulz_distributed(torch.randn(4), lambda t: None)
    with pytest.raises(ValueError, match=r"coefficients\[0\] must be a triple"):
        gram_newton_schulz_distributed(torch.randn(4, 8), lambda t: None, coefficients=[(1,)])


def test_a_prepared_input_is_written_only_into_a_matching_buffer() -> None:
    from dmuon_ns._prepare import prepare

    prepared = prepare(torch.randn(2, 6, 4), torch.float16, 1e-7)  # tall: written as (2, 4, 6)
    out = torch.zeros(2, 4, 6, dtype=torch.float16)
    assert prepared.write(out) is out and torch.equal(out, prepared.write())
    for bad in (
        torch.zeros(2, 6, 4, dtype=torch.float16),
        torch.zeros(2, 4, 6, dtype=torch.bfloat16),
        torch.zeros(2, 6, 4, dtype=torch.float16).mT,
    ):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float16 tensor"):
            prepared.write(bad)
        assert not bad.any()  # nothing written
    with pytest.raises(ValueError, match=r"on cpu, got a contiguous .* on meta"):
        prepared.write(torch.empty(2, 4, 6, dtype=torch.float16, device="meta"))


def test_a_loop_kernel_names_an_unknown_op() -> None:
    from dmuon_ns._torch_kernel import TORCH_KERNEL

    with pytest.raises(ValueError, match="op must be 'gram' or 'direct', got 'polar'"):
        TORCH_KERNEL.loop("polar", torch.zeros(1, 2, 4), [(3.0, -3.0, 1.0)], ())
