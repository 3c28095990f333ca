"""The shared NS loops: where the Gram iteration rounds its first ``Q``, and how long each of
its tensors lives."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from dmuon_ns import POLAR_EXPRESS_COEFFICIENTS, NewtonSchulz
from dmuon_ns._iterations import Owned, TorchProducts, direct_iterations, gram_iterations
from dmuon_testing.memory import StoragePeak, live_storages


class RecordingProducts(TorchProducts):
    """Torch's products, with a copy of each symmetric product's operands and result."""

    def __init__(self) -> None:
        self.sym_calls: list[tuple[Tensor, Tensor, Tensor]] = []

    def sym(self, a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float) -> Tensor:
        out = super().sym(a, b, c, alpha=alpha, beta=beta)
        self.sym_calls.append((a.clone(), b.clone(), out.clone()))
        return out


def _scaled(*shape: int) -> Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    return (x / x.norm(dim=(-2, -1), keepdim=True)).half()


def _is_rounded_plus_identity(q: Tensor, z: Tensor, a: float) -> bool:
    """``q`` is the fp16 ``z`` with ``a`` added to its diagonal and rounded once more: equal
    off the diagonal, within an fp16 step of ``z_ii + a`` on it (torch's CPU and CUDA adds
    need not round the same way)."""
    off = ~torch.eye(z.shape[-1], dtype=torch.bool)
    diagonal = z.diagonal(dim1=-2, dim2=-1).double() + a
    step = torch.finfo(torch.float16).eps * diagonal.abs()
    near = (q.diagonal(dim1=-2, dim2=-1).double() - diagonal).abs() <= step
    return torch.equal(q[..., off], z[..., off]) and bool(near.all())


def test_first_q_is_the_rounded_z_prime_plus_a_after_the_r_update_read_z_prime() -> None:
    products = RecordingProducts()
    coefficients = POLAR_EXPRESS_COEFFICIENTS[:2]
    (a0, _, _), _ = coefficients
    gram_iterations(products, _scaled(2, 24, 40), coefficients, ()).finish()
    z0, rz, r1, _, q1 = products.sym_calls
    # The R update reads Z' itself (R·Z' + a·R, then Z'·(R·Z') + a·(R·Z')), not Z' + aI ...
    assert torch.equal(rz[1], z0[2]) and torch.equal(r1[0], z0[2])
    # ... and the next Q·Z' starts from Z' rounded, plus a·I, rounded again.
    assert _is_rounded_plus_identity(q1[0], z0[2], a0)


def test_a_single_step_ends_on_the_first_q() -> None:
    products = RecordingProducts()
    (a, b, c), x = POLAR_EXPRESS_COEFFICIENTS[0], _scaled(1, 16, 32)
    last = gram_iterations(products, x, [(a, b, c)], ())
    ((_, _, z),) = products.sym_calls  # no R update: Z' is the only symmetric product
    q, operand = last.operands
    assert _is_rounded_plus_identity(q, z, a) and operand is x


class _Watching(TorchProducts):
    """Torch products that note, at each Gram matrix, whether the original input is alive."""

    def __init__(self, original: weakref.ref[Tensor]) -> None:
        self.original = original
        self.alive: list[bool] = []

    def gram(self, x: Tensor) -> Tensor:
        self.alive.append(self.original() is not None)
        return super().gram(x)


def _handed_over(run, owned: bool) -> list[bool]:
    x = torch.randn(1, 8, 24, dtype=torch.float64)
    products = _Watching(weakref.ref(x))
    arg = Owned(x) if owned else x
    if owned:
        del x
    run(products, arg).finish()
    return products.alive


def test_a_handed_over_input_is_freed_once_it_is_no_longer_read() -> None:
    coeffs = tuple(tuple(row) for row in POLAR_EXPRESS_COEFFICIENTS[:3])

    def gram(products, x):
        return gram_iterations(products, x, coeffs, (2,))

    def direct(products, x):
        return direct_iterations(products, x, coeffs)

    # The Gram form reads its input until the restart's product; the direct form until its
    # first step's. A caller's own tensor stays alive, of course.
    assert _handed_over(gram, owned=True) == [True, False]
    assert _handed_over(gram, owned=False) == [True, True]
    assert _handed_over(direct, owned=True) == [True, False, False]
    assert _handed_over(direct, owned=False) == [True, True, True]
    owned = Owned(torch.zeros(1, 2, 3))
    owned.take()
    try:
        owned.take()
    except RuntimeError as err:
        assert "taken once" in str(err)
    else:
        raise AssertionError("an Owned input was taken twice")


class _CountingSquares(TorchProducts):
    """Torch products that note, before each product, how many of the m×m matrices they have
    returned are still alive (the loop's references are the only ones)."""

    def __init__(self) -> None:
        self.squares: list[weakref.ref[Tensor]] = []
        self.alive: list[tuple[str, int]] = []

    def _note(self, kind: str) -> None:
        self.alive.append((kind, sum(ref() is not None for ref in self.squares)))

    def _made(self, out: Tensor) -> Tensor:
        if out.shape[-1] == out.shape[-2]:
            self.squares.append(weakref.ref(out))
        return out

    def gram(self, x: Tensor) -> Tensor:
        self._note("gram")
        return self._made(super().gram(x))

    def sym(self, a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float) -> Tensor:
        self._note("sym")
        return self._made(super().sym(a, b, c, alpha=alpha, beta=beta))

    def mm(self, a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        self._note("mm")
        return self._made(super().mm(a, b, out_dtype))


def test_each_m_by_m_matrix_is_dropped_once_it_is_read_for_the_last_time() -> None:
    # [Note: m×m lifetimes]: a step forms its products beside R, Q and Z' at most, and the
    # restart's Q·X (the first "mm") and the last product beside Q alone.
    products = _CountingSquares()
    coeffs = tuple(tuple(row) for row in POLAR_EXPRESS_COEFFICIENTS[:5])
    last = gram_iterations(products, Owned(_scaled(2, 8, 24)), coeffs, (2,))
    restart = next(alive for kind, alive in products.alive if kind == "mm")
    assert restart == 1, products.alive
    assert max(alive for _, alive in products.alive) == 3, products.alive
    # Once the loop has returned, the last product's Q is the only m×m matrix alive.
    assert sum(ref() is not None for ref in products.squares) == 1
    assert last.operands[0].shape == (2, 8, 8)


def test_a_gram_call_peaks_at_its_iterate_the_restarted_one_and_q() -> None:
    # A whole call at the 2:7 aspect of 4096×14336, by live storage: the scaled input and the
    # restarted iterate (each the input's size) and Q (2/7 of it), nothing else at once. The
    # iteration dtype is the input's, so the last product writes the result with no cast.
    g = torch.randn(1, 64, 224, dtype=torch.bfloat16)
    ns = NewtonSchulz(dtype=torch.bfloat16)
    peak = StoragePeak(set(live_storages()))
    with peak:
        ns(g)
    # (Plus the fp32 norm; the loop of before held three more m×m matrices: 3.14 × g.)
    assert peak.peak <= 2 * g.nbytes + 64 * 64 * 2 + 64, peak.peak / g.nbytes
