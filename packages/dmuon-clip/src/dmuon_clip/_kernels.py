"""Triton kernels of the fused segmented clip. Imported lazily by ``_fastpath`` and importable
without triton (the kernels are then simply not defined), so the package stays importable alone.

[Note: chunk table]
Every tensor the kernels touch is cut into chunks of ``CHUNK`` elements; one program handles one
chunk, so a launch covers any number of tensors of one dtype. A chunk is one row of an int64
table ``(offset, body_len, tail_len, slot)``:

- ``offset``: element offset of the chunk from ``base`` (the first tensor of the launch). Every
  tensor is 16-byte aligned, so offsets are multiples of ``VEC = 16 // itemsize`` and the
  compiler may issue 16-byte vector loads (the ``multiple_of`` hints below are true by
  construction, see ``_fastpath._build_plan``).
- ``body_len``: a multiple of ``VEC`` (≤ ``CHUNK``), so the mask ``idx < body_len`` is constant
  over each vector; ``tail_len`` (< ``VEC``) covers the ragged end of a tensor's last chunk.
- ``slot``: the bucket the chunk belongs to.

[Note: deterministic two-stage reduction]
Pass 1 writes one partial per chunk (no atomics). Stage 2 runs one program per bucket that walks
all partials in a fixed order and keeps those of its bucket, so the result does not depend on
scheduling: the same grads give bit-identical norms on every run. Walking every partial per bucket
costs ``n_buckets x n_chunks`` reads of 12 bytes, nothing next to reading the grads.

[Note: NaN under the inf-norm]
``max`` may drop NaN (in Triton's reductions, and in NCCL's MAX all-reduce), which would let a NaN
gradient pass as finite. Under the inf-norm a chunk that holds a NaN therefore reports ``+inf``:
the bucket is flagged as non-finite and no reduction can lose it. The 2-norm needs no care: NaN
and inf survive sums.
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # the fast path reports "triton is not installed"
    triton = None  # type: ignore[assignment]

__all__ = ["bucket_reduce", "finalize", "partial_norm", "scale"]

if triton is not None:

    @triton.jit
    def partial_norm(
        base_ptr,
        table_ptr,
        partial_ptr,
        INF_NORM: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        VEC: tl.constexpr,
    ):
        """Pass 1: one fp32 partial per chunk, the sum of squares or the max |x|."""
        pid = tl.program_id(0)
        row = table_ptr + pid * 4
        offset = tl.multiple_of(tl.load(row), VEC)
        body_len = tl.multiple_of(tl.load(row + 1), VEC)
        tail_len = tl.load(row + 2)
        ptr = base_ptr + offset
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        nan_seen = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK):
            idx = i + tl.arange(0, BLOCK)
            x = tl.load(ptr + idx, mask=idx < body_len, other=0.0).to(tl.float32)
            if INF_NORM:
                acc = tl.maximum(acc, tl.abs(x))
                nan_seen += tl.where(x != x, 1.0, 0.0)
            else:
                acc += x * x
        tidx = tl.arange(0, VEC)
        t = tl.load(ptr + body_len + tidx, mask=tidx < tail_len, other=0.0).to(tl.float32)
        if INF_NORM:
            result = tl.maximum(tl.max(acc), tl.max(tl.abs(t)))
            bad = tl.sum(nan_seen) + tl.sum(tl.where(t != t, 1.0, 0.0))
            result = tl.where(bad > 0, float("inf"), result)
        else:
            result = tl.sum(acc) + tl.sum(t * t)
        tl.store(partial_ptr + pid, result)

    @triton.jit
    def bucket_reduce(
        table_ptr,
        partial_ptr,
        n_chunks,
        sums_ptr,
        INF_NORM: tl.constexpr,
        BLOCK: tl.constexpr,
        N_ITERS: tl.constexpr,
    ):
        """Stage 2: one program per bucket slot reduces its chunks' partials in a fixed order.
        ``N_ITERS`` (a power of two >= n_chunks / BLOCK) is a compile-time trip count: loop bounds
        read from arguments are not supported by Triton's interpreter, and rounding to a power of
        two bounds the number of compiled variants."""
        slot = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for it in range(0, N_ITERS):
            idx = it * BLOCK + tl.arange(0, BLOCK)
            in_range = idx < n_chunks
            mine = tl.load(table_ptr + idx * 4 + 3, mask=in_range, other=-1) == slot
            v = tl.load(partial_ptr + idx, mask=in_range & mine, other=0.0)
            if INF_NORM:
                acc = tl.maximum(acc, v)
            else:
                acc += v
        if INF_NORM:
            tl.store(sums_ptr + slot, tl.max(acc))
        else:
            tl.store(sums_ptr + slot, tl.sum(acc))

    @triton.jit
    def finalize(
        sums_ptr,
        max_norm_ptr,
        n_slots,
        out_ptr,
        flags_ptr,
        INF_NORM: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """Norms and coefficients of every bucket in one program, with the arithmetic of
        ``torch.nn.utils.clip_grad_norm_``: ``min(max_norm * (1 / (total + 1e-6)), 1)``.

        Writes ``out = [totals(n), coefs(n), combined]`` and ``flags = [clipped(n),
        found_inf(n)]``; a negative max norm means "measure only"."""
        s = tl.arange(0, BLOCK_S)
        valid = s < n_slots
        sums = tl.load(sums_ptr + s, mask=valid, other=0.0)
        max_norm = tl.load(max_norm_ptr + s, mask=valid, other=-1.0)
        if INF_NORM:
            total = sums
            combined = tl.max(sums)
        else:
            total = tl.sqrt_rn(sums)
            combined = tl.sqrt_rn(tl.sum(sums))
        finite = (total - total) == 0.0
        one = tl.full([BLOCK_S], 1.0, tl.float32)  # div_rn does not broadcast a scalar
        coef = tl.minimum(tl.div_rn(one, total + 1e-6) * max_norm, 1.0)
        active = finite & (max_norm >= 0.0)
        clipped = active & (coef < 1.0)
        applied = tl.where(clipped, coef, 1.0)
        tl.store(out_ptr + s, total, mask=valid)
        tl.store(out_ptr + n_slots + s, applied, mask=valid)
        tl.store(out_ptr + 2 * n_slots, combined)
        tl.store(flags_ptr + s, clipped.to(tl.uint8), mask=valid)
        tl.store(flags_ptr + n_slots + s, (~finite).to(tl.uint8), mask=valid)

    @triton.jit
    def scale(
        base_ptr,
        table_ptr,
        coef_ptr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        VEC: tl.constexpr,
    ):
        """Pass 2: multiply a chunk in place by its bucket's coefficient (fp32 math, rounded
        once, as ``torch._foreach_mul_`` does). A coefficient of exactly 1 skips the chunk: a
        bucket that is not clipped costs no memory traffic, and no host sync decides it."""
        pid = tl.program_id(0)
        row = table_ptr + pid * 4
        coef = tl.load(coef_ptr + tl.load(row + 3))
        if coef == 1.0:
            return
        offset = tl.multiple_of(tl.load(row), VEC)
        body_len = tl.multiple_of(tl.load(row + 1), VEC)
        tail_len = tl.load(row + 2)
        ptr = base_ptr + offset
        for i in range(0, CHUNK, BLOCK):
            idx = i + tl.arange(0, BLOCK)
            m = idx < body_len
            x = tl.load(ptr + idx, mask=m, other=0.0)
            tl.store(ptr + idx, (x.to(tl.float32) * coef).to(x.dtype), mask=m)
        tidx = tl.arange(0, VEC)
        tm = tidx < tail_len
        t = tl.load(ptr + body_len + tidx, mask=tm, other=0.0)
        tl.store(ptr + body_len + tidx, (t.to(tl.float32) * coef).to(t.dtype), mask=tm)
