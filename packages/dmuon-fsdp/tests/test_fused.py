"""The Muon elementwise passes: the Triton kernels (Triton's interpreter on CPU, and on a GPU)
and the torch ops give the same bits; both agree with a float64 evaluation of the formulas; a
skipped step stores exactly the old values; ``Muon(model)`` compiles the kernels off the
training thread (GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

pytest.importorskip("triton")

# Run as a script: on CPU under TRITON_INTERPRET=1, or on CUDA; argv[1] is the device.
_BODY = textwrap.dedent(
    """
    import sys
    import torch
    from dmuon_fsdp.optim import _fused

    device = torch.device(sys.argv[1])
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=gen, device=device).mul_(3).to(dtype)

    def both(run, *tensors):
        # run(kernel, *copies) on fresh copies of tensors, once per implementation.
        results = []
        for kernel in (True, False):
            copies = [t.clone() for t in tensors]
            run(kernel, *copies)
            results.append(copies)
        return results

    skips = {
        "none": None,
        "off": torch.zeros((), dtype=torch.bool, device=device),
        "on": torch.ones((), dtype=torch.bool, device=device),
    }
    momentum, decay, step = 0.95, 1 - 0.02 * 0.1, -0.02 * 1.5

    def same_bits(a, b, where):
        if a.dtype == torch.bfloat16 and device.type == "cpu":
            # Triton's interpreter rounds fp32 -> bf16 toward zero, a GPU (and torch) to
            # nearest even: one bf16 step apart there (of the largest value, for the Nesterov
            # input, which adds to a rounded buffer), the same bits on a GPU.
            step = 2**-7 * b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=2**-7, atol=step, msg=where)
        else:
            assert torch.equal(a, b), where
    # (state, gradient) dtypes: bf16 weights; fp32 states and grads; mixed; fp16.
    for state, grad_dtype in (
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ):
        for nesterov in (True, False):
            for name, skip in skips.items():
                buf = randn(33, 70, dtype=state)
                grad = randn(33, 70, dtype=grad_dtype)
                if name == "on":
                    grad[3, 5] = float("nan")
                out = torch.empty(33, 70, dtype=state, device=device)
                assert _fused.fused_available(buf, grad, out)

                def run(kernel, buf, grad, out):
                    _fused.momentum_into(
                        [buf], [grad], [out], skip, momentum, nesterov, kernel=kernel
                    )

                (kb, _, ko), (tb, _, to) = both(run, buf, grad, out)
                where = f"momentum {state} {grad_dtype} nesterov={nesterov} skip={name}"
                same_bits(kb, tb, where)
                if name == "on":
                    assert torch.equal(kb, buf), where  # the old bits
                    continue
                same_bits(ko, to, where)
                new = buf.double() * momentum + grad.double()
                torch.testing.assert_close(kb, new.to(state), rtol=1e-2, atol=1e-2, msg=where)
                # The Nesterov input adds to the buffer as stored (rounded to its dtype).
                stored = kb.double()
                value = grad.double() + momentum * stored if nesterov else stored
                torch.testing.assert_close(ko, value.to(state), rtol=1e-2, atol=1e-2, msg=where)

        # The update, on a row-major and on a transposed NS result (tall matrices give one).
        for transposed in (False, True):
            for name, skip in skips.items():
                p = randn(40, 24, dtype=state)
                u = randn(24, 40, dtype=state).t() if transposed else randn(40, 24, dtype=state)
                if name == "on":
                    u = u * float("nan")
                assert _fused.fused_available(p) and u.is_contiguous() is not transposed

                def run(kernel, p, u):
                    _fused.update_weight([p], [u], skip, decay, step, kernel=kernel)

                (kp, _), (tp, _) = both(run, p, u)
                where = f"update {state} transposed={transposed} skip={name}"
                same_bits(kp, tp, where)
                if name == "on":
                    assert torch.equal(kp, p), where
                    continue
                expected = (p.double() * decay + step * u.double()).to(state)
                torch.testing.assert_close(kp, expected, rtol=1e-2, atol=1e-2, msg=where)
    # Several matrices in one call ([Note: one launch per batch]): separate tensors, views of
    # one stack, an offset that breaks 16-byte alignment, two dtype combinations; each matrix
    # gets the bits it gets alone.
    for nesterov in (True, False):
        stack = randn(4, 33, 70, dtype=torch.float32)
        flat = randn(33 * 70 + 1, dtype=torch.float32)
        bufs = [randn(33, 70, dtype=torch.bfloat16), stack[1], flat[1:].view(33, 70), stack[3]]
        grads = [randn(33, 70, dtype=torch.float32) for _ in bufs]
        outs = list(torch.empty(4, 33, 70, dtype=torch.float32, device=device))
        outs[0] = torch.empty(33, 70, dtype=torch.bfloat16, device=device)  # the NS input
        alone = [(b.clone(), o.clone()) for b, o in zip(bufs, outs)]  # has the buffer's dtype
        for (b, o), g in zip(alone, grads):
            _fused.momentum_into([b], [g], [o], None, momentum, nesterov, kernel=False)
        _fused.momentum_into(bufs, grads, outs, None, momentum, nesterov, kernel=True)
        for i, ((b, o), kb, ko) in enumerate(zip(alone, bufs, outs)):
            where = f"batched momentum {i} nesterov={nesterov}"
            same_bits(kb, b, where)
            same_bits(ko, o, where)
    # Transposed results (a tall matrix's) over several 64x64 tiles with ragged edges.
    params = [randn(130, 70, dtype=torch.bfloat16), randn(130, 70, dtype=torch.float32)]
    params.append(randn(130 * 70 + 1, dtype=torch.float32)[1:].view(130, 70))  # off 16 bytes
    updates = randn(3, 70, 130, dtype=torch.float32).transpose(1, 2)
    alone = [p.clone() for p in params]
    for p, u in zip(alone, updates):
        _fused.update_weight([p], [u], None, decay, step, kernel=False)
    _fused.update_weight(params, list(updates), None, decay, step, kernel=True)
    for i, (kp, p) in enumerate(zip(params, alone)):
        same_bits(kp, p, f"batched update {i}")
    # Scalars from the device ([Note: hyperparameters on the device]): each matrix reads its
    # row of the table, and gets the bits the scalar arguments give it (the arguments passed
    # beside the table are wrong on purpose: the kernels must not read them).
    hyper = [(0.9, 1 - 0.01 * 0.1, -0.01 * 2.0), (momentum, decay, step)]
    values = torch.tensor(hyper, dtype=torch.float32, device=device)
    rows = [1, 0, 1]
    for nesterov in (True, False):
        for name, skip in skips.items():
            bufs = [randn(33, 70, dtype=torch.bfloat16) for _ in rows]
            grads = [randn(33, 70, dtype=torch.float32) for _ in rows]
            outs = [torch.empty(33, 70, dtype=torch.bfloat16, device=device) for _ in rows]
            alone = [(b.clone(), o.clone()) for b, o in zip(bufs, outs)]
            for (b, o), g, r in zip(alone, grads, rows):
                _fused.momentum_into([b], [g], [o], skip, hyper[r][0], nesterov, kernel=True)
            # The gradients from the device too: offsets from an anchor, the listed ones decoys.
            anchor = torch.empty(16, dtype=torch.float32, device=device)
            offsets = [(g.data_ptr() - anchor.data_ptr()) // 4 for g in grads]
            grad_offsets = torch.tensor([0, *offsets], dtype=torch.int64, device=device)
            decoys = [torch.zeros_like(g) for g in grads]
            hps = {
                "scalars": (_fused.DeviceScalars(values, rows), grads),
                "scalars+grads": (
                    _fused.DeviceScalars(
                        values, rows, grad_offsets, [1, 2, 3], {torch.float32: anchor}
                    ),
                    decoys,
                ),
            }
            for label, (hp, listed) in hps.items():
                kbufs, kouts = [b.clone() for b in bufs], [o.clone() for o in outs]
                _fused.momentum_into(kbufs, listed, kouts, skip, 0.0, nesterov, kernel=True, hp=hp)
                for i, ((b, o), kb, ko) in enumerate(zip(alone, kbufs, kouts)):
                    where = f"device momentum {label} {i} nesterov={nesterov} skip={name}"
                    assert torch.equal(kb, b), where
                    if name != "on":
                        assert torch.equal(ko, o), where
    for transposed in (False, True):
        for name, skip in skips.items():
            params = [randn(130, 70, dtype=torch.bfloat16) for _ in rows]
            updates = [
                randn(70, 130, dtype=torch.float32).t() if transposed
                else randn(130, 70, dtype=torch.float32)
                for _ in rows
            ]
            alone = [p.clone() for p in params]
            for p, u, r in zip(alone, updates, rows):
                _fused.update_weight([p], [u], skip, hyper[r][1], hyper[r][2], kernel=True)
            hp = _fused.DeviceScalars(values, rows)
            _fused.update_weight(params, updates, skip, 0.0, 0.0, kernel=True, hp=hp)
            for i, (kp, p) in enumerate(zip(params, alone)):
                assert torch.equal(kp, p), f"device update {i} transposed={transposed} {name}"
    # A step split in two (the NS input during backward, the momentum in the step) gives
    # momentum_into's bits, in each implementation; the first half leaves the buffer alone.
    for state, grad_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        for nesterov in (True, False):
            for kernel in (True, False):
                buf = randn(33, 70, dtype=state)
                grad = randn(33, 70, dtype=grad_dtype)
                whole_buf, whole_out = buf.clone(), torch.empty_like(buf)
                _fused.momentum_into(
                    [whole_buf], [grad], [whole_out], None, momentum, nesterov, kernel=kernel
                )
                first_buf, first_out = buf.clone(), torch.empty_like(buf)
                _fused.ns_input_into(
                    [first_buf], [grad], [first_out], momentum, nesterov, kernel=kernel
                )
                where = f"split {state} nesterov={nesterov} kernel={kernel}"
                assert torch.equal(first_buf, buf), where
                assert torch.equal(first_out, whole_out), where
                for name, skip in skips.items():
                    second = buf.clone()
                    _fused.advance_momentum([second], [grad], skip, momentum, kernel=kernel)
                    assert torch.equal(second, buf if name == "on" else whole_buf), where
    # Not contiguous: the torch ops run instead.
    assert not _fused.fused_available(torch.zeros(4, 4, device=device).t())
    print("ok")
    """
)


def _run_body(device: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _BODY, device], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


def test_kernels_and_torch_ops_give_the_same_bits() -> None:
    _run_body("cpu", {**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.gpu
def test_kernels_and_torch_ops_give_the_same_bits_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _run_body("cuda", dict(os.environ))


_BACKGROUND_BODY = textwrap.dedent(
    """
    import os, tempfile
    import torch, torch.distributed as dist, triton
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import dmuon
    from dmuon_fsdp.optim import _fused
    from _models import batch, build, loss_fn, muon_predicate

    torch.cuda.set_device(0)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{tmp}/rdv", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    compiles = []
    def hook(*, fn, is_manual_warmup, repr, **_):
        compiles.append((fn.name, is_manual_warmup, repr))
    triton.knobs.runtime.jit_post_compile_hook = hook
    def torch_ops(*args, **kwargs):
        raise AssertionError("the torch ops ran where the compiled kernels should have")
    _fused._times = torch_ops  # every torch-ops branch starts with it
    # bf16 weights; fp32 masters with bf16 compute (FSDP2's policy): other dtypes per kernel.
    for dtype, mp in ((torch.bfloat16, None), (torch.float32, torch.bfloat16)):
        with torch.device("cuda"):
            model = build().to(dtype)
        dmuon.dedicate_params(model, mesh, muon_predicate)
        kwargs = {"ignored_params": dmuon.dedicated_params_of(model)}
        if mp is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        opt = dmuon.Muon(model, lr=0.02)
        for thread in list(_fused._background):
            thread.join()
        warmed = len(compiles)
        assert warmed and all(warmup for _, warmup, _ in compiles), compiles
        for step in range(2):
            loss_fn(model, batch(step, 4).cuda()).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        late = [c for c in compiles[warmed:] if c[0].endswith(("momentum_kernel", "update_kernel"))]
        assert not late, f"compiled in the step, not in the background: {late}"
        compiles.clear()
    dist.destroy_process_group()
    print("ok")
    """
)


@pytest.mark.gpu
def test_step_launches_only_kernels_compiled_in_the_background() -> None:
    """[Note: compiling off the training thread]: ``Muon(model)`` compiles every signature its
    steps launch, so no step compiles (a new Triton cache: nothing is on disk)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tests_dir = os.path.dirname(__file__)
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "TRITON_CACHE_DIR": cache,
            "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(
            [sys.executable, "-c", _BACKGROUND_BODY],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
