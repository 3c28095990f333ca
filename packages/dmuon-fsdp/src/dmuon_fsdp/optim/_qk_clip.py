"""QK-clip (MuonClip): after each step, shrink the query and key projections of every attention
head whose largest logit in the step went over a threshold, so that the logit lands on it.

[Note: QK-clip]
Per attention head ``h`` the statistic is ``S_h``, the largest pre-softmax logit
``scale · q_i · k_j`` of the step (every micro-batch, every query and unmasked key). After the
update, a head with ``S_h > τ`` gets ``γ_h = τ / S_h`` (others ``γ_h = 1``): its rows of W_q
are multiplied by ``γ_h^α`` and its rows of W_k by ``γ_h^(1−α)``, so its logits scale by
exactly ``γ_h`` and its largest one on that data lands on τ. Which rows belong to which head,
and which power of ``γ`` they take, is a row map per weight (:class:`QKRowMap`):

- plain multi-head attention: a head's ``head_dim`` rows of W_q take ``γ^α``, of W_k
  ``γ^(1−α)``;
- grouped-query attention: a key head serves a group of query heads, so the group takes the
  smallest ``γ`` of its heads (every query head of the group and the shared key head are
  scaled with it: the group's largest logit lands on τ, the others shrink by the same factor);
- multi-head latent attention (DeepSeek-V3, Kimi K2): a query head is ``[q_nope | q_rope]``
  and the key ``[k_nope | k_rope]`` with ``k_rope`` shared by every head, so ``q_nope`` takes
  ``γ^α``, ``k_nope`` (rows of ``kv_b_proj``) ``γ^(1−α)``, ``q_rope`` the whole ``γ`` and the
  shared ``k_rope`` nothing; the value rows of ``kv_b_proj`` are left alone;
- a bias of a projection (Qwen2's ``q_proj.bias``) is part of q or k and is scaled with its
  rows.

Attentions that normalise q and k after the projection (Qwen3's, GLM-4.5's ``q_norm`` /
``k_norm``) cancel any scale of W_q and W_k: they are reported with a warning and never
scaled (their statistic is still recorded for logging). Heads at or under τ are not touched at
all: their rows are multiplied by exactly 1, so they keep every bit.

[Note: where the statistic is reduced]
Every rank records the maxima of its own micro-batches and of its own heads (a tensor-parallel
rank sees its share of the heads; the other columns stay ``-inf``). One MAX all-reduce of the
whole ``(attentions, heads)`` buffer over every rank (data-parallel, HSDP and tensor-parallel
ranks at once) then gives each rank every head's maximum over the global batch. It is
launched at the start of ``Muon.step()``, before the step waits for the gradients, and
waited for by the scaling, after the Muon and AdamW updates: the 16 KB (Kimi K2's 61 × 64
heads) travel while the step runs. Launching it earlier, at the end of the last micro-batch's
forward, would race with activation checkpointing: the recompute passes of backward call the
attention again and write into the buffer the reduce is reading. At the start of the step
every forward and recompute of the step is over. The buffer is then reset for the next step.
Nothing waits on the host: a NCCL work's ``wait()`` only orders the current stream, and the
scale factors are computed on the device (``last_max_logits()`` is the one call that copies to
the host).

[Note: a pipeline stage's metadata inference]
Before its first micro-batch (and after a switch between training and evaluation) a
``PipelineStage`` of ``torch.distributed.pipelining`` runs its module once to learn the shapes
it sends, with gradients on (torch 2.13's dynamic metadata inference, which a stage runs
unless built with both ``input_args`` and ``output_args``; torchtitan's is not): the first stage on its real inputs,
every other stage on ``torch.empty`` tensors, and then a backward of it (which runs an
activation checkpoint's recompute, the forward again). An attention there reports the logits
of whatever that memory held, NaN or finite garbage, and the step's maximum would take them: a
NaN left every head of the stage unclipped in the first step, a large value would shrink its
heads for nothing. ``observe`` ignores what is reported while a stage's inference runs, forward
or backward, which ``attach`` watches for (``watch_pipeline_metadata_inference``) on a pipeline
stage's model; the micro-batches themselves, the real data, follow it.

[Note: the row scale]
The scaling is a post-update hook (see [Note: the post-update hook] in _step_plan): every rank
scales the rows it steps, in place, between the update and the publish, so no byte goes on the
wire for it. Owners scale their full masters of dedicated weights, or their tensor-parallel
shard (the part's row offset maps local rows to global heads); ranks scale their local rows of
q/k weights left to FSDP2 (``Shard(0)`` shards, or any placement that keeps rows whole) and,
on the replicated path, the replicated weights whole, identically on every rank. Peers,
replicas and FSDP2's all-gather then see the scaled weight from the next forward on.
The per-row factors come from one table built at the first step (uploaded without waiting for
the device): for every row a rank holds,
the index of its head's group and the power of ``γ`` it takes (0 for rows that are not q or k).
A step then computes ``γ`` for every head, the minimum per group (one ``scatter_reduce``), one
gather and one power for every row, and one multiply per weight. A step skipped for a
non-finite gradient keeps every weight (see [Note: non-finite gradients]), so the clip does
not act in it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils.hooks import RemovableHandle

from .._checks import is_int, is_number
from .._matrix import is_single_matrix
from .._profile import span
from .._torch_internals import (
    foreach_mul_,
    pipeline_metadata_inference_running,
    watch_pipeline_metadata_inference,
)
from .._warnings import warn
from ..holder import DedicatedParam, WeightPart, tensor_view
from ..runtime import DedicatedRuntime
from ._optimizer import Muon
from ._parts import MuonParts

__all__ = ["QKClip", "QKRowMap"]

# The kinds of rows a row map names (see QKRowMap).
_KINDS = ("q", "k", "q_rope", "skip")


def _exponent(kind: str, alpha: float) -> float | None:
    """The power of γ a row of ``kind`` takes, as a function of α (``None``: the row is left
    alone)."""
    if kind == "q":
        return alpha
    if kind == "k":
        return 1.0 - alpha
    if kind == "q_rope":
        return 1.0
    return None


@dataclass(frozen=True)
class QKRowMap:
    """Where the heads of a projection weight sit along its first dimension (see [Note:
    QK-clip]).

    ``blocks`` is one head's rows in order, as ``(kind, rows)`` pairs: ``"q"`` rows take
    ``γ^α``, ``"k"`` rows ``γ^(1−α)``, ``"q_rope"`` rows (a query part whose key part is shared
    by all heads, MLA's rotary half) the whole ``γ``, and ``"skip"`` rows nothing (values in a
    fused key/value weight). Head ``h`` starts at row ``start + h * stride`` (``stride``
    defaults to the rows of one head: heads back to back). Examples: MHA/GQA
    ``QKRowMap((("q", 128),))``; an MLA query ``QKRowMap((("q", 128), ("q_rope", 64)))`` and its
    ``kv_b_proj`` ``QKRowMap((("k", 128), ("skip", 128)))``; the key third of a fused
    ``[Q | K | V]`` weight ``QKRowMap((("k", 128),), start=num_heads * 128)``.

    Args:
        blocks: one head's rows, in order, as ``(kind, rows)`` pairs: ``kind`` one of ``"q"``,
            ``"k"``, ``"q_rope"``, ``"skip"``, ``rows`` an int >= 1; at least one block must
            not be ``"skip"``. Anything else raises ``ValueError``.
        start: the row of the weight where head 0 starts, an int >= 0.
        stride: the rows from one head's start to the next, an int at least the rows of one
            head (the sum of ``blocks``' rows); ``None``: exactly one head's rows, heads back
            to back.
    """

    blocks: tuple[tuple[str, int], ...]
    start: int = 0
    stride: int | None = None

    def __post_init__(self) -> None:
        try:
            blocks = tuple((kind, rows) for kind, rows in self.blocks)
        except (TypeError, ValueError):
            raise ValueError(
                f"QKRowMap blocks must be (kind, rows) pairs, got {self.blocks!r}"
            ) from None
        for kind, rows in blocks:
            if kind not in _KINDS:
                raise ValueError(f"QKRowMap: unknown row kind {kind!r}; use one of {list(_KINDS)}")
            if not is_int(rows) or rows < 1:
                raise ValueError(f"QKRowMap: rows of {kind!r} must be a positive int, got {rows!r}")
        if not any(kind != "skip" for kind, _ in blocks):
            raise ValueError(
                f"QKRowMap {blocks!r} has no 'q', 'k' or 'q_rope' rows: nothing to scale"
            )
        object.__setattr__(self, "blocks", blocks)
        for name in ("start", "stride"):
            value = getattr(self, name)
            if value is None and name == "stride":
                continue
            if not is_int(value) or value < 0:
                raise ValueError(f"QKRowMap.{name} must be an int >= 0, got {value!r}")
        if self.stride is not None and self.stride < self.head_rows:
            raise ValueError(
                f"QKRowMap.stride ({self.stride}) is smaller than one head's rows"
                f" ({self.head_rows}): heads would overlap"
            )

    @property
    def head_rows(self) -> int:
        return sum(rows for _, rows in self.blocks)

    @property
    def _head_stride(self) -> int:
        """The rows from one head's start to the next."""
        return self.head_rows if self.stride is None else self.stride

    def end(self, heads: int) -> int:
        """One past the last row of ``heads`` heads."""
        return self.start + (heads - 1) * self._head_stride + self.head_rows

    def rows_and_powers(self, heads: int, alpha: float) -> tuple[Tensor, Tensor]:
        """``(heads, n)`` row indices of the rows that are scaled, and their ``(n,)`` powers."""
        offsets, powers, at = [], [], 0
        for kind, rows in self.blocks:
            power = _exponent(kind, alpha)
            if power is not None:
                offsets.append(torch.arange(at, at + rows))
                powers.append(torch.full((rows,), power, dtype=torch.float32))
            at += rows
        heads_at = self.start + torch.arange(heads) * self._head_stride
        return heads_at[:, None] + torch.cat(offsets)[None, :], torch.cat(powers)


class _Attention(NamedTuple):
    """One ``QKClip.add`` call."""

    q: str
    k: str
    heads: int
    kv_heads: int
    q_rows: QKRowMap | None
    k_rows: QKRowMap | None
    qk_norm: bool | None


class _Row(NamedTuple):
    """What ``observe`` needs of one attention: its row of the statistic, its head count, and
    this rank's tensor-parallel position when its W_q is a dedicated TP shard."""

    row: int
    heads: int
    tp_index: int
    tp_size: int


class _Rows(NamedTuple):
    """Every row of one weight (or bias): its head's group slot and its power of γ (0: not
    scaled), and whether a row map covers it."""

    group: Tensor
    power: Tensor
    covered: Tensor

    def merge(self, other: _Rows) -> _Rows:
        """The rows of two row maps of one (fused) weight, which cover disjoint rows."""
        return _Rows(
            torch.where(other.covered, other.group, self.group),
            torch.where(other.covered, other.power, self.power),
            self.covered | other.covered,
        )


class _Table(NamedTuple):
    """The scaling of this rank's rows (see [Note: the row scale])."""

    head_group: Tensor  # (attentions * heads,): group slot of each head (a trash slot for none)
    groups: Tensor  # (slots + 1,): γ per group, refilled every step
    factors: Tensor  # one factor per row this rank scales, refilled every step
    row_group: Tensor  # group slot of each of those rows
    row_power: Tensor  # power of γ of each of those rows
    tensors: list[Tensor]  # the parts to scale
    views: list[Tensor]  # each part's factors, shaped to broadcast over its rows


class RemovableHandles:
    """Several hook handles removed together."""

    def __init__(self, *handles: RemovableHandle) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class QKClip:
    """QK-clip for :class:`Muon` (see [Note: QK-clip]): ``tau`` is the threshold τ of the
    largest logit per head (``math.inf``: only record the statistic), ``alpha`` the share
    ``α`` of the scale that goes to W_q (the rest goes to W_k).

    Register each attention with :meth:`add` (or :meth:`from_model` for Hugging Face
    attention modules), attach the object to the optimizer (``clip.attach(optimizer)``), and
    call :meth:`observe` in each attention's forward with the step's per-head maxima (see
    ``dmuon.max_logits``). No optimizer state: checkpoints are unchanged.

    Args:
        tau: the threshold τ, a number > 0: after each step, a head whose largest logit ``S``
            went over it has its query and key rows scaled so that its logits shrink by
            ``τ / S``; ``math.inf``: never scale, only record the statistic.
        alpha: the share α of the scale that goes to W_q, in ``[0, 1]``: a head's query rows
            are multiplied by ``γ^α`` and its key rows by ``γ^(1−α)``.
    """

    def __init__(self, tau: float = 100.0, alpha: float = 0.5) -> None:
        for name, value in (("tau", tau), ("alpha", alpha)):
            if not is_number(value):
                raise TypeError(f"QKClip: {name} must be a number, got {value!r}")
        if not tau > 0:
            raise ValueError(
                f"QKClip: tau must be > 0 (the largest logit a head may keep; K2 uses 100,"
                f" math.inf only records), got {tau!r}"
            )
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(
                f"QKClip: alpha must be in [0, 1] (the share of the scale W_q takes), got {alpha!r}"
            )
        self.tau = float(tau)
        self.alpha = float(alpha)
        self._attentions: list[_Attention] = []
        self._rows: dict[str, _Row] = {}
        self._stats: Tensor | None = None  # (attentions, heads): this step's local maxima
        self._reduced: Tensor | None = None  # the last step's global maxima
        self._work: Any = None  # the pending all-reduce
        self._group: Any = None  # every rank's process group (None: one rank)
        self._weights: dict[str, _Rows] = {}  # what to scale, by FQN
        self._bases: dict[int, int] = {}  # first group slot of each attention that is scaled
        self._slots = 0  # group slots: key heads of every attention that is scaled
        self._table: _Table | None = None
        self._bound = False
        self._observed = False
        self._warned_unobserved = False

    # -- registration -------------------------------------------------------------------------

    def add(
        self,
        q: str,
        k: str,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        q_rows: QKRowMap | None = None,
        k_rows: QKRowMap | None = None,
        qk_norm: bool | None = None,
    ) -> None:
        """Register one attention: ``q`` and ``k`` are the FQNs of its query and key projection
        weights (the same FQN twice for a fused projection, then with both row maps),
        ``num_heads`` its query heads, ``num_kv_heads`` its key heads (default: as many; fewer
        for grouped-query attention). ``q_rows`` / ``k_rows`` say where each head's rows sit
        (default: ``rows / heads`` rows per head, back to back, all scaled). ``qk_norm=True``
        marks an attention that normalises q and k (never scaled); ``None`` detects a
        ``q_norm`` / ``k_norm`` submodule of the module holding the projections.

        Args:
            q: the FQN of the query projection weight (as in ``model.named_parameters()``), a
                non-empty string that no attention added before uses.
            k: the FQN of the key projection weight; equal to ``q`` for a fused projection,
                which then needs both ``q_rows`` and ``k_rows``.
            num_heads: the attention's query heads, an int >= 1.
            num_kv_heads: its key heads, an int >= 1 that divides ``num_heads``; ``None``: as
                many as ``num_heads``.
            q_rows: where each head's rows sit in the query weight (:class:`QKRowMap`);
                ``None``: ``rows / num_heads`` rows per head, back to back, all ``"q"``.
            k_rows: the same for the key weight; ``None``: ``rows / num_kv_heads`` rows per
                key head, back to back, all ``"k"``.
            qk_norm: ``True``: the attention normalises q and k after the projections, so it is
                recorded but never scaled; ``False``: scaled; ``None``: ``True`` when the
                module holding the projections has a ``q_norm`` or ``k_norm`` submodule.
        """
        if self._bound:
            raise ValueError(
                "QKClip.add after clip.attach(optimizer): add every attention before attaching it"
            )
        for role, fqn in (("q", q), ("k", k)):
            if not isinstance(fqn, str) or not fqn:
                raise TypeError(f"QKClip.add: {role} must be a parameter FQN (str), got {fqn!r}")
        kv = num_heads if num_kv_heads is None else num_kv_heads
        for what, count in (("num_heads", num_heads), ("num_kv_heads", kv)):
            if not is_int(count) or count < 1:
                raise ValueError(f"QKClip.add({q!r}): {what} must be a positive int, got {count!r}")
        if num_heads % kv:
            raise ValueError(
                f"QKClip.add({q!r}): num_heads ({num_heads}) must be a multiple of num_kv_heads"
                f" ({kv})"
            )
        for argument, mapping in (("q_rows", q_rows), ("k_rows", k_rows)):
            if mapping is not None and not isinstance(mapping, QKRowMap):
                raise TypeError(
                    f"QKClip.add({q!r}): {argument} must be a dmuon.qk_clip.QKRowMap or None, got"
                    f" {mapping!r}"
                )
        if q == k and (q_rows is None or k_rows is None):
            raise ValueError(
                f"QKClip.add: {q!r} is both the query and the key projection (a fused weight);"
                " pass q_rows= and k_rows= (dmuon.qk_clip.QKRowMap) to say where each head's q and k"
                " rows are"
            )
        taken = {w for a in self._attentions for w in {a.q, a.k}}
        for weight in {q, k}:
            if weight in taken:
                raise ValueError(
                    f"QKClip.add: {weight!r} is already part of another attention; each weight"
                    " can be scaled for one attention only"
                )
        if qk_norm is not None and not isinstance(qk_norm, bool):
            raise TypeError(f"QKClip.add({q!r}): qk_norm must be a bool or None, got {qk_norm!r}")
        self._rows[q] = _Row(len(self._attentions), num_heads, 0, 1)
        self._attentions.append(_Attention(q, k, num_heads, kv, q_rows, k_rows, qk_norm))

    @classmethod
    def from_model(cls, model: nn.Module, tau: float = 100.0, alpha: float = 0.5) -> QKClip:
        """A clip with every Hugging Face-style attention of ``model`` added: Llama, Mistral,
        Qwen2/3-style modules (``q_proj`` / ``k_proj`` with the model config's
        ``num_attention_heads``, ``num_key_value_heads`` and ``head_dim``; ``q_norm`` /
        ``k_norm`` marks QK-norm) and DeepSeek-V3's multi-head latent attention (``q_b_proj``,
        or ``q_proj`` without a query LoRA, and ``kv_b_proj``, with ``qk_nope_head_dim``,
        ``qk_rope_head_dim`` and ``v_head_dim``).

        Args:
            model: the model whose attentions to add (before or after ``dedicate_params``:
                only names and the modules' configs are read); one without a known attention
                raises ``ValueError``.
            tau: the threshold τ, as for :class:`QKClip`.
            alpha: the share α of the scale for W_q, as for :class:`QKClip`.
        """
        clip = cls(tau, alpha)
        for name, module in model.named_modules():
            found = _hf_attention(name, module)
            if found is not None:
                q, k, heads, kv, q_rows, k_rows, qk_norm = found
                clip.add(q, k, heads, kv, q_rows=q_rows, k_rows=k_rows, qk_norm=qk_norm)
        if not clip._attentions:
            raise ValueError(
                f"QKClip.from_model found no attention in {type(model).__name__}: it knows"
                " modules with q_proj/k_proj (or q_b_proj/kv_b_proj) and a config with"
                " num_attention_heads; register other attentions with clip.add(q, k, num_heads)"
            )
        return clip

    @property
    def names(self) -> tuple[str, ...]:
        """The query weight of each attention, in the order of the rows of
        :meth:`last_max_logits`."""
        return tuple(a.q for a in self._attentions)

    # -- the statistic ------------------------------------------------------------------------

    def observe(
        self,
        q: str,
        max_logits: Tensor,
        *,
        first_head: int | None = None,
        training: bool | None = None,
    ) -> None:
        """Record the largest logit of each of this rank's heads of attention ``q`` (the FQN
        given to :meth:`add`) in this forward: ``max_logits`` has one entry per head this rank
        computes. Call it once per forward of the attention (every micro-batch; recompute
        passes of activation checkpointing too: they see the same values). The step keeps the
        maximum of every call.

        Under tensor parallelism a rank computes only its heads: when W_q is a dedicated
        tensor-parallel shard (``Shard(0)``) and ``max_logits`` has ``num_heads / tp``
        entries, they are taken as heads ``tp_index * len(max_logits)`` onwards; elsewhere
        pass ``first_head``, the global index of the first one. ``training`` (default
        ``torch.is_grad_enabled()``) says whether this forward trains; one that does not
        (evaluation, generation) is not recorded. Costs one in-place maximum on the device.

        Args:
            q: the query weight FQN the attention was added with (:meth:`add`); another
                raises ``ValueError``.
            max_logits: a 1-D tensor of the largest logit of each head this rank computes in
                this forward (all ``num_heads``, or this rank's share under tensor
                parallelism), on the device the model trains on.
            first_head: the global index of ``max_logits``' first head, an int >= 0 such that
                every entry is one of the attention's heads; ``None``: 0 when ``max_logits``
                covers every head, ``tp_index * len(max_logits)`` for a dedicated
                tensor-parallel W_q.
            training: whether this forward trains (only then is it recorded); ``None``:
                ``torch.is_grad_enabled()``.
        """
        if training is None:
            training = torch.is_grad_enabled()
        if not training or pipeline_metadata_inference_running():
            # See [Note: a pipeline stage's metadata inference].
            return
        row = self._rows.get(q)
        if row is None:
            raise ValueError(
                f"QKClip.observe: {q!r} was not added; pass the query weight FQN given to"
                f" QKClip.add ({len(self._rows)} added, e.g. {next(iter(self._rows), None)!r})"
            )
        if not isinstance(max_logits, Tensor):
            raise TypeError(
                f"QKClip.observe: max_logits must be a 1-D tensor of per-head maxima, got "
                f"{type(max_logits).__name__}"
            )
        count = max_logits.shape[0] if max_logits.dim() == 1 else -1
        if first_head is None:
            if count == row.heads:
                first_head = 0
            elif row.tp_size > 1 and count * row.tp_size == row.heads:
                first_head = row.tp_index * count
            else:
                raise ValueError(
                    f"QKClip.observe({q!r}): max_logits has shape {tuple(max_logits.shape)}, not"
                    f" ({row.heads},) (every head) nor ({row.heads // row.tp_size},) (this"
                    " tensor-parallel rank's heads); pass one maximum per head this rank"
                    " computes, with first_head= the global index of the first"
                )
        elif count < 0 or first_head < 0 or first_head + count > row.heads:
            raise ValueError(
                f"QKClip.observe({q!r}): heads {first_head}..{first_head + count - 1} of"
                f" max_logits {tuple(max_logits.shape)} are not within the attention's"
                f" {row.heads} heads"
            )
        stats = self._statistic(max_logits.device)
        if stats.device != max_logits.device:
            raise ValueError(
                f"QKClip.observe({q!r}): max_logits is on {max_logits.device}, the statistic on"
                f" {stats.device} (the device Muon's model trains on); compute it there"
            )
        target = stats[row.row, first_head : first_head + count]
        torch.maximum(target, max_logits.detach(), out=target)
        self._observed = True

    def last_max_logits(self) -> Tensor:
        """The largest logit of every head over the global batch of the last step,
        ``(attentions, heads)`` float32 on the CPU (rows in :attr:`names` order; ``-inf``:
        not observed, or past an attention's head count). This copy is the only host sync QK-
        clip makes."""
        if self._reduced is None:
            return torch.full(self._shape(), -math.inf)
        return self._reduced.to("cpu", copy=True)

    def _shape(self) -> tuple[int, int]:
        return len(self._attentions), max((a.heads for a in self._attentions), default=0)

    def _statistic(self, device: torch.device) -> Tensor:
        if self._stats is None:
            self._stats = torch.full(self._shape(), -math.inf, device=device)
        return self._stats

    # -- inside Muon --------------------------------------------------------------------------

    def attach(self, optimizer: Muon) -> RemovableHandles:
        """Clip inside every ``step()`` of ``optimizer`` (a ``dmuon.Muon``): a pre-step hook
        launches the all-reduce of the statistic, a post-update hook scales the rows (see
        [Note: where the statistic is reduced]). The clip is part of the update: its post-update
        hook runs before the hooks registered without ``prepend``, whenever they were
        registered, so an :class:`EMA` built before or after the attach averages the clipped
        weights. Checks every attention against the optimizer's model first (nothing is
        attached if that raises). Returns a handle whose ``remove()`` detaches both hooks; a
        QKClip serves one optimizer."""
        if not callable(getattr(optimizer, "register_post_update_hook", None)):
            parts = (
                "; with several model parts per rank attach one QKClip, of the part's own"
                " attentions, to each part's Muon in optimizer.optimizers"
                if isinstance(optimizer, MuonParts)
                else ""
            )
            raise TypeError(
                f"QKClip.attach takes dmuon's Muon optimizer, got {type(optimizer).__name__}: "
                f"the clip runs inside Muon.step, as a post-update hook{parts}"
            )
        self.bind(optimizer.model, optimizer.runtime)
        return RemovableHandles(
            optimizer.register_pre_step_hook(lambda _: self.launch()),
            optimizer.register_post_update_hook(self.post_update, prepend=True),
        )

    def bind(self, model: nn.Module, runtime: DedicatedRuntime) -> None:
        """Check every attention against ``model`` and prepare the step (``attach`` calls this;
        nothing changes if it raises)."""
        if self._bound:
            raise ValueError(
                "this QKClip is already attached to an optimizer; build one QKClip per Muon"
            )
        if not self._attentions:
            raise ValueError(
                "QKClip.attach: the QKClip has no attention: call clip.add(q, k, num_heads) for"
                " each attention, or build it with QKClip.from_model(model)"
            )
        params = dict(model.named_parameters())
        dedicated = {dp.fqn: dp for dp in runtime.params}
        weights: dict[str, _Rows] = {}
        rows: dict[str, _Row] = {}
        bases: dict[int, int] = {}
        slot = 0
        for index, attention in enumerate(self._attentions):
            for fqn in (attention.q, attention.k):
                _check_projection(fqn, params, dedicated)
            if _uses_qk_norm(model, attention):
                warn(
                    f"QKClip: the attention of {attention.q!r} normalises q and k (QK-norm), so"
                    " scaling W_q and W_k cannot change its logits; it is not clipped (its"
                    " maxima are still recorded)"
                )
            else:
                for fqn, table in _attention_rows(attention, params, slot, self.alpha):
                    if fqn not in (attention.q, attention.k):  # a bias (q and k: above)
                        _check_param(fqn, params, dedicated)
                    weights[fqn] = _with_rows(weights.get(fqn), table, fqn)
                bases[index] = slot
                slot += attention.kv_heads
            dp = dedicated.get(attention.q)
            tp_size = runtime.layout.tp_size if dp is not None and dp.tp_dim == 0 else 1
            tp_index = runtime.layout.tp_index if tp_size > 1 else 0
            rows[attention.q] = _Row(index, attention.heads, tp_index, tp_size)
        device = runtime.layout.device
        group = runtime.global_group
        self._group = group if dist.get_world_size(group) > 1 else None
        self._weights, self._rows, self._bases, self._slots = weights, rows, bases, slot
        if self._stats is not None and self._stats.device != device:
            self._stats = self._stats.to(device)
        self._statistic(device)
        self._reduced = torch.full(self._shape(), -math.inf, device=device)
        if runtime.layout.pp_size > 1:
            watch_pipeline_metadata_inference()
        self._bound = True

    def launch(self) -> None:
        """Start the step's MAX all-reduce of the statistic and reset the statistic (see
        [Note: where the statistic is reduced])."""
        assert self._stats is not None and self._reduced is not None, "QKClip is not bound"
        if not self._observed and not self._warned_unobserved:
            self._warned_unobserved = True
            warn(
                "QKClip: no attention was observed in this step, so nothing can be clipped;"
                " call clip.observe(q_name, max_logits) in each attention's forward"
                " (see dmuon.max_logits)"
            )
        self._observed = False
        self._reduced.copy_(self._stats)
        self._stats.fill_(-math.inf)
        if self._group is not None:
            self._work = dist.all_reduce(
                self._reduced, op=dist.ReduceOp.MAX, group=self._group, async_op=True
            )

    def post_update(self, optimizer: Any, parts: Mapping[str, WeightPart]) -> None:
        """The post-update hook: wait for the statistic and scale the rows of every head over
        τ in the parts this rank steps (see [Note: the row scale])."""
        with span("dmuon::qk_clip"):
            if self._work is not None:
                self._work.wait()
                self._work = None
            if self._table is None:
                self._table = self._build_table(parts)
            table = self._table
            if not table.tensors:
                return
            assert self._reduced is not None
            peak = self._reduced.reshape(-1)
            over = (peak > self.tau) & torch.isfinite(peak)
            over &= ~optimizer.last_step_stats.skipped.to(peak.device)
            gamma = torch.where(over, self.tau / peak, 1.0)
            table.groups.fill_(1.0).scatter_reduce_(0, table.head_group, gamma, "amin")
            torch.index_select(table.groups, 0, table.row_group, out=table.factors)
            table.factors.pow_(table.row_power)
            foreach_mul_(table.tensors, table.views)

    def _build_table(self, parts: Mapping[str, WeightPart]) -> _Table:
        """The scaling table of the parts this rank steps (once, at the first step)."""
        assert self._reduced is not None
        device = self._reduced.device
        attentions, width = self._shape()
        trash = self._slots
        head_group = torch.full((attentions, width), trash, dtype=torch.long)
        for index, base in self._bases.items():
            attention = self._attentions[index]
            per_group = attention.heads // attention.kv_heads
            head_group[index, : attention.heads] = base + torch.arange(attention.heads) // per_group
        tensors, groups, powers, sizes = [], [], [], []
        for fqn, rows in self._weights.items():
            part = parts.get(fqn)
            if part is None or part.tensor.numel() == 0:
                continue
            first, count = part.offsets[0], part.tensor.shape[0]
            local_power = rows.power[first : first + count]
            if not bool((local_power != 0).any()):
                continue
            tensors.append(part.tensor)
            groups.append(rows.group[first : first + count])
            powers.append(local_power)
            sizes.append(count)
        row_group = _upload(
            torch.cat(groups) if groups else torch.empty(0, dtype=torch.long), device
        )
        row_power = _upload(torch.cat(powers) if powers else torch.empty(0), device)
        factors = torch.empty(row_group.shape, device=device)
        views, at = [], 0
        for tensor, count in zip(tensors, sizes):
            views.append(factors[at : at + count].view(count, *([1] * (tensor.dim() - 1))))
            at += count
        return _Table(
            _upload(head_group.reshape(-1), device),
            torch.ones(trash + 1, device=device),
            factors,
            row_group,
            row_power,
            tensors,
            views,
        )


def _upload(table: Tensor, device: torch.device) -> Tensor:
    """``table`` on ``device``; to a GPU from pinned memory, so the copy does not wait for the
    device (the first step builds the tables, and a step makes no host sync)."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def _check_param(
    fqn: str, params: Mapping[str, nn.Parameter], dedicated: Mapping[str, DedicatedParam]
) -> None:
    """A weight QK-clip scales must be a trainable parameter whose rows a rank holds whole."""
    param = params.get(fqn)
    if param is None:
        module, _, leaf = fqn.rpartition(".")
        tail = f".{module.rpartition('.')[2]}.{leaf}"  # e.g. ".q_proj.weight"
        # A missing prefix ("model.") first, else the same projection of another layer.
        near = [n for n in params if n.endswith(f".{fqn}")]
        near = near or [n for n in params if f".{n}".endswith(tail)]
        raise ValueError(
            f"QKClip: {fqn!r} is not a parameter of the model; pass FQNs as"
            f" model.named_parameters() lists them{f' (e.g. {near[0]!r})' if near else ''}"
        )
    if not param.requires_grad:
        raise ValueError(
            f"QKClip: {fqn!r} is frozen (requires_grad=False), so no optimizer steps it and its"
            " rows cannot be scaled; unfreeze it or leave its attention out of the clip"
        )
    if fqn not in dedicated:
        for _, placement in tensor_view(param).mesh_dims():
            if type(placement) not in (Shard, Replicate):
                raise ValueError(
                    f"QKClip: {fqn!r} is a DTensor with placement {placement!r}, whose local"
                    " rows are not one block of the weight's rows; QK-clip scales plain"
                    " Shard/Replicate placements. Dedicate the weight to an owner (select it"
                    " in dedicate_params' predicate) or shard it with fully_shard alone"
                )


def _check_projection(
    fqn: str, params: Mapping[str, nn.Parameter], dedicated: Mapping[str, DedicatedParam]
) -> None:
    """A q or k projection weight: a parameter :func:`_check_param` accepts, and a matrix."""
    _check_param(fqn, params, dedicated)
    if not is_single_matrix(params[fqn].shape):
        raise ValueError(
            f"QKClip: {fqn!r} has shape {tuple(params[fqn].shape)}, not a projection "
            "matrix; pass the q and k projections' weights (a norm's weight would be "
            "scaled as a head's rows)"
        )


def _with_rows(known: _Rows | None, table: _Rows, fqn: str) -> _Rows:
    """The rows of weight ``fqn``: ``table``, merged with the ``known`` rows of a fused weight
    (its q and k rows in one table), which must cover other rows."""
    if known is None:
        return table
    if bool((known.covered & table.covered).any()):
        raise ValueError(
            f"QKClip: the q and k row maps of {fqn!r} overlap; each row is"
            " a query row, a key row or neither"
        )
    return known.merge(table)


def _attention_rows(
    attention: _Attention, params: Mapping[str, nn.Parameter], slot: int, alpha: float
) -> Iterator[tuple[str, _Rows]]:
    """Per weight of ``attention`` (W_q, W_k and their biases), every row's group slot and
    power of γ (0: not scaled). Group slots start at ``slot``, one per key head."""
    heads, kv = attention.heads, attention.kv_heads
    q_group = slot + torch.arange(heads) // (heads // kv)
    k_group = slot + torch.arange(kv)
    q_map = _row_map(attention.q, attention.q_rows, heads, "q", params)
    hint = _kv_heads_hint(attention, _kind_rows(q_map, "q"), params)
    k_map = _row_map(attention.k, attention.k_rows, kv, "k", params, hint)
    _check_head_size(attention, q_map, k_map, hint)
    for fqn, mapping, count, group in (
        (attention.q, q_map, heads, q_group),
        (attention.k, k_map, kv, k_group),
    ):
        total = params[fqn].shape[0]
        rows, powers = mapping.rows_and_powers(count, alpha)
        table = _Rows(
            torch.zeros(total, dtype=torch.long),
            torch.zeros(total, dtype=torch.float32),
            torch.zeros(total, dtype=torch.bool),
        )
        table.group[rows] = group[:, None].expand_as(rows)
        table.power[rows] = powers[None, :].expand_as(rows)
        table.covered[rows] = True
        yield fqn, table
        # A bias adds to the projection's output rows: it is part of q or k.
        if fqn.endswith(".weight"):
            bias = fqn[: -len("weight")] + "bias"
            if bias in params and tuple(params[bias].shape) == (total,):
                yield bias, table


def _row_map(
    fqn: str,
    mapping: QKRowMap | None,
    count: int,
    kind: str,
    params: Mapping[str, nn.Parameter],
    hint: str = "",
) -> QKRowMap:
    """``mapping``, or the default one (``rows / count`` rows per head, back to back, all
    ``kind``), checked against the weight's rows; ``hint`` ends the message of a default
    map that does not fit."""
    total = params[fqn].shape[0]
    if mapping is None:
        if total % count:
            raise ValueError(
                f"QKClip: {fqn!r} has {total} rows, not a multiple of its {count} heads{hint};"
                f" or pass {kind}_rows=dmuon.qk_clip.QKRowMap(...) to say where each head's rows"
                " are"
            )
        mapping = QKRowMap(((kind, total // count),))
    if mapping.end(count) > total:
        raise ValueError(
            f"QKClip: the {kind} row map of {fqn!r} needs {mapping.end(count)} rows for"
            f" {count} heads, the weight has {total}"
        )
    return mapping


def _kind_rows(mapping: QKRowMap, kind: str) -> int:
    return sum(rows for each, rows in mapping.blocks if each == kind)


def _kv_heads_hint(attention: _Attention, q_rows: int, params: Mapping[str, nn.Parameter]) -> str:
    """For an attention added with as many key heads as query heads and its default key map:
    the ``num_kv_heads`` its key weight holds at the query heads' size, when that is a
    grouped-query count (fewer, dividing ``num_heads``); else empty."""
    k_total = params[attention.k].shape[0]
    if attention.k_rows is not None or attention.kv_heads != attention.heads or not q_rows:
        return ""
    kv, rest = divmod(k_total, q_rows)
    if rest or not 0 < kv < attention.heads or attention.heads % kv:
        return ""
    return (
        f"; for grouped-query attention pass num_kv_heads={kv}"
        f" (QKClip.add({attention.q!r}, {attention.k!r}, num_heads={attention.heads},"
        f" num_kv_heads={kv}))"
    )


def _check_head_size(attention: _Attention, q_map: QKRowMap, k_map: QKRowMap, hint: str) -> None:
    """A query head's ``"q"`` rows and a key head's ``"k"`` rows meet in one dot product, so
    they are as many: otherwise the head counts given do not describe the weights (a GQA
    attention added without ``num_kv_heads`` would scale half of each key head)."""
    q_rows, k_rows = _kind_rows(q_map, "q"), _kind_rows(k_map, "k")
    if q_rows != k_rows:
        raise ValueError(
            f"QKClip: the attention of {attention.q!r} has {q_rows} query rows per head"
            f" ({attention.heads} heads) but {k_rows} key rows per head in {attention.k!r}"
            f" ({attention.kv_heads} key heads), and q·kᵀ needs heads of one size{hint}; or"
            " pass q_rows= / k_rows= (dmuon.qk_clip.QKRowMap) to say where each head's rows are"
        )


def _uses_qk_norm(model: nn.Module, attention: _Attention) -> bool:
    """``attention.qk_norm``, or, when ``None``, whether the module holding its projections
    has a ``q_norm`` or ``k_norm`` submodule (Qwen3, GLM-4.5, OLMo-2)."""
    if attention.qk_norm is not None:
        return attention.qk_norm
    parts = attention.q.split(".")
    if len(parts) < 2:
        return False
    children = _children(model.get_submodule(".".join(parts[:-2])))
    return "q_norm" in children or "k_norm" in children


def _count(holder: object, attribute: str) -> int | None:
    """``holder.attribute`` when it is a positive int (a head count), else ``None``."""
    value = getattr(holder, attribute, None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _children(module: nn.Module) -> dict[str, nn.Module]:
    """The submodules ``module`` registers, by attribute name."""
    return dict(module.named_children())


def _hf_attention(name: str, module: nn.Module) -> _Attention | None:
    """The ``QKClip.add`` arguments for a Hugging Face attention module, or ``None``."""
    config = getattr(module, "config", None)
    prefix = f"{name}." if name else ""
    children = _children(module)
    if "kv_b_proj" in children:
        query = "q_b_proj" if "q_b_proj" in children else "q_proj"
        if query not in children or config is None:
            return None
        heads = int(config.num_attention_heads)
        nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        value = int(config.v_head_dim)
        return _Attention(
            f"{prefix}{query}.weight",
            f"{prefix}kv_b_proj.weight",
            heads,
            heads,
            QKRowMap((("q", nope), ("q_rope", rope))),
            QKRowMap((("k", nope), ("skip", value))),
            False,
        )
    if "q_proj" not in children or "k_proj" not in children:
        return None
    # The module's own head count first: an encoder-decoder's config holds the encoder's
    # (BART maps num_attention_heads to encoder_attention_heads), its decoder modules theirs.
    heads_of = _count(module, "num_heads") or _count(config, "num_attention_heads")
    if config is None or heads_of is None:
        raise ValueError(
            f"QKClip.from_model: {name!r} has q_proj and k_proj but no config with"
            " num_attention_heads; add it with clip.add(q, k, num_heads, num_kv_heads)"
        )
    heads = heads_of
    groups = _count(module, "num_key_value_groups")  # Llama and its kin: heads per kv head
    kv = heads // groups if groups else _count(config, "num_key_value_heads") or heads
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    head_dim = int(head_dim or config.hidden_size // heads)
    return _Attention(
        f"{prefix}q_proj.weight",
        f"{prefix}k_proj.weight",
        heads,
        kv,
        QKRowMap((("q", head_dim),)),
        QKRowMap((("k", head_dim),)),
        None,
    )
