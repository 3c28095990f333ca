"""An exponential moving average of the weights, kept where each weight is stepped.

[Note: the weight EMA]
``torch.optim.swa_utils.AveragedModel`` keeps its average in a copy of the model, and a model
after ``dedicate_params`` (or after ``fully_shard``) cannot be copied: a rank holds only its
share of the weights. An average needs no copy. After every update, a post-update hook gets
the part of each weight that this rank stepped (see [Note: the post-update hook]): the
owner's full master of a dedicated matrix, this rank's FSDP2 shard, a tensor-parallel shard, a
replicated weight whole. :class:`EMA` keeps its average beside each part, so it costs every
rank its share of the model (as the optimizer states do), moves no byte and needs no host sync:

    average ← average + (1 − decay)·(weight − average)

in ``dtype`` (fp32 by default, whatever the weight's dtype: a bf16 average would stop moving
once the change per step falls below bf16's resolution). A step skipped for a non-finite
gradient leaves the average too (the factor is 0 on the device). The average starts at the
weights the optimizer holds when the ``EMA`` is built.

Using the average goes through the model: :meth:`EMA.applied` writes it into the parts and
ends the way a step ends (the owners publish, FSDP2 modules gather again), so every rank's
forward computes with it, on any path (1-D, HSDP, TP, replicated, expert stacks); on exit the
weights come back bit for bit. Saving and loading go through the model too, with dmuon's
topology-free state dicts (:meth:`EMA.state_dict` gathers the averaged weights like
:func:`get_model_state_dict`), so an average saved at one world size loads at another.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._profile import no_mark
from ._torch_internals import foreach_lerp_
from .checkpoint import checked_on_every_rank, get_model_state_dict, set_model_state_dict
from .holder import WeightPart, fsdp_modules
from .optim import Muon, MuonParts
from .topology import all_gather_numbers

__all__ = ["EMA"]


class EMA:
    """An exponential moving average of every weight ``optimizer`` steps, kept where each part
    of it is stepped (see [Note: the weight EMA]).

    Build it once the weights hold their starting values (after initialisation, or after a
    checkpoint load). It registers a post-update hook, which runs after a :class:`QKClip`'s
    (attached before or after it), so that it averages the clipped weights; :meth:`remove`
    takes it out. Collective:
    every rank builds it, with the same ``decay`` (``ValueError`` on every rank otherwise).

    Args:
        optimizer: the :class:`Muon` whose weights are averaged.
        decay: the weight of the old average at each step, a float in (0, 1) (0.999: about the
            last 1000 steps).
        dtype: the dtype the average is kept in (``torch.float32``); a floating dtype.
    """

    def __init__(
        self, optimizer: Muon, decay: float = 0.999, *, dtype: torch.dtype = torch.float32
    ) -> None:
        if not isinstance(optimizer, Muon):
            parts = (
                "; with several model parts per rank build one EMA per part's Muon:"
                " [dmuon.EMA(o, decay) for o in optimizer.optimizers]"
                if isinstance(optimizer, MuonParts)
                else ""
            )
            raise TypeError(
                "EMA takes the dmuon.Muon whose weights it averages, got"
                f" {type(optimizer).__name__}{parts}"
            )

        def check() -> None:
            if _valid_decay(decay) is None:
                raise ValueError(f"EMA: decay must be a float in (0, 1), e.g. 0.999, got {decay!r}")
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"EMA: dtype must be a floating torch.dtype, got {dtype!r}")

        self._optimizer = optimizer
        checked_on_every_rank(optimizer.runtime, "EMA", check)
        seen = _on_every_rank((float(decay), zlib.crc32(str(dtype).encode())), self._host_group())
        if len({rate for rate, _ in seen}) > 1:
            raise ValueError(
                f"EMA: decay differs across ranks ({_by_rank(seen)}): each rank would average at"
                " its own rate; build the EMA with the same decay on every rank"
            )
        if len({kind for _, kind in seen}) > 1:
            raise ValueError(
                f"EMA: dtype differs across ranks (this rank's: {dtype}); build the EMA with the"
                " same dtype on every rank"
            )
        self.decay = float(decay)
        with torch.no_grad():
            self._average = {
                name: part.tensor.detach().to(dtype, copy=True)
                for name, part in self._parts().items()
            }
        # The step's lists, made once: the averages are only ever written in place.
        self._names = list(self._average)
        self._averages = list(self._average.values())
        self._handle = optimizer.register_post_update_hook(self._update)

    @property
    def decay(self) -> float:
        """The weight of the old average at each step. Set it between steps to change the rate
        (a warm-up of the decay); every rank must set the same value. A value outside (0, 1)
        raises ``ValueError`` and leaves the rate as it was: the average would grow without
        bound, or turn NaN, and the next step writes it."""
        return self._decay

    @decay.setter
    def decay(self, value: float) -> None:
        decay = _valid_decay(value)
        if decay is None:
            raise ValueError(
                f"EMA.decay must be a float in (0, 1), e.g. 0.999, got {value!r}; the average"
                " keeps its rate (set the same value on every rank)"
            )
        self._decay = decay

    @property
    def average(self) -> Mapping[str, Tensor]:
        """This rank's part of the average of each weight it steps, by name (the parts'
        layout: see :class:`WeightPart`)."""
        return self._average

    def remove(self) -> None:
        """Stop averaging (unregister the hook); the average keeps its last value."""
        self._handle.remove()

    def _parts(self) -> dict[str, WeightPart]:
        return self._optimizer._plan.weight_parts()

    def _host_group(self) -> dist.ProcessGroup | None:
        return self._optimizer._runtime.comm_ctx.host_group()

    @torch.no_grad()
    def _update(self, optimizer: Muon, parts: Mapping[str, WeightPart]) -> None:
        averages = self._averages
        if not averages:
            return
        weights = [parts[n].tensor.to(averages[0].dtype) for n in self._names]
        rate = 1.0 - self.decay
        skipped = optimizer.last_step_stats.skipped
        if skipped is None:
            foreach_lerp_(averages, weights, rate)
        else:
            factor = torch.where(skipped.to(averages[0].device), 0.0, rate).to(averages[0].dtype)
            foreach_lerp_(averages, weights, factor)

    # -- using the average ----------------------------------------------------------------------

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block the model computes with the average (every rank: collective on
        entry and exit; call it between steps, on every rank). On exit the weights and buffers
        are those of before, bit for bit."""
        with self._swapped(keep=False):
            yield

    @contextlib.contextmanager
    def _swapped(self, *, keep: bool) -> Iterator[None]:
        """The average in the model for the block; ``keep``: what the model holds at the end
        of the block becomes the average (a load)."""
        optimizer = self._optimizer
        model = optimizer.model
        parts = self._parts()
        weights = {name: part.tensor.clone() for name, part in parts.items()}
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        self._write(parts, self._average)
        try:
            with optimizer._weights_lent("ema.applied()"):
                yield
            if keep:
                with torch.no_grad():
                    for name, part in parts.items():
                        self._average[name].copy_(part.tensor)
        finally:
            self._write(parts, weights)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])

    def _write(self, parts: Mapping[str, WeightPart], values: Mapping[str, Tensor]) -> None:
        """Write ``values`` into ``parts`` and end as a step ends, so that every rank's next
        forward reads them: no collective of dmuon's in flight reads the old values, no FSDP2
        module keeps a gathered copy (the root's stays gathered after a forward without a
        backward), and the owners publish (see [Note: step order])."""
        optimizer = self._optimizer
        optimizer._runtime.drain()
        for _, module in fsdp_modules(optimizer.model):
            module.reshard()
        with torch.no_grad():
            for name, part in parts.items():
                part.tensor.copy_(values[name])
        optimizer._publish(no_mark)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self, *, cpu_offload: bool = True, rank0_only: bool = False) -> dict[str, Any]:
        """``{"decay": float, "weights": {fqn: full tensor}}``: the averaged weights gathered
        as :func:`get_model_state_dict` gathers the model's (buffers are the model's own).
        Collective; it loads at any topology.

        Args:
            cpu_offload: ``True``: each tensor moves to the CPU as soon as it is gathered;
                ``False``: it stays on the device. A bool.
            rank0_only: ``True``: only rank 0 keeps the weights (the others get ``{}`` under
                ``"weights"``); ``False``: every rank does. A bool.
        """
        with self.applied():
            weights = get_model_state_dict(
                self._optimizer.model, cpu_offload=cpu_offload, rank0_only=rank0_only
            )
        return {"decay": self.decay, "weights": weights}

    def load_state_dict(
        self, state_dict: Mapping[str, Any], *, broadcast_from_rank0: bool = False
    ) -> None:
        """Load what :meth:`state_dict` returned; the model's weights and buffers are
        unchanged. Collective; raises on every rank, before anything changes, when it does not
        fit.

        Args:
            state_dict: ``{"decay": float in (0, 1), "weights": {fqn: full tensor}}`` with
                every key of the model's state dict, as :func:`set_model_state_dict` takes it
                (ignored on every rank but 0 with ``broadcast_from_rank0``).
            broadcast_from_rank0: ``True``: only global rank 0 reads ``state_dict`` (pass
                ``{}`` elsewhere) and sends each weight where it is kept. A bool.
        """
        decay = _decay_of(state_dict)
        group = self._host_group()
        if broadcast_from_rank0:  # rank 0's decay, on every rank
            decay = _from_rank0(decay, group)
            if decay is None:
                raise ValueError(
                    "EMA.load_state_dict takes what EMA.state_dict() returned: {'decay': float"
                    " in (0, 1), 'weights': {fqn: tensor}}, on rank 0 (with"
                    " broadcast_from_rank0=True it alone reads it)"
                )
        else:  # each rank read its own: agree before the load

            def check() -> None:
                if decay is None:
                    raise ValueError(
                        "EMA.load_state_dict takes what EMA.state_dict() returned: {'decay':"
                        " float in (0, 1), 'weights': {fqn: tensor}}"
                    )

            checked_on_every_rank(self._optimizer.runtime, "EMA.load_state_dict", check)
            assert decay is not None  # else check() raised, on every rank
            decays = _on_every_rank((decay,), group)
            if len(set(decays)) > 1:
                raise ValueError(
                    f"EMA.load_state_dict: the ranks' state dicts hold other decays"
                    f" ({_by_rank(decays)}); load the same state dict on every rank, or pass it"
                    " on rank 0 with broadcast_from_rank0=True"
                )
        weights = state_dict.get("weights", {}) if isinstance(state_dict, Mapping) else {}
        try:
            with self._swapped(keep=True):
                set_model_state_dict(
                    self._optimizer.model, weights, broadcast_from_rank0=broadcast_from_rank0
                )
        except ValueError as error:  # raised on every rank, nothing changed
            raise ValueError(f"EMA.load_state_dict: the averaged weights: {error}") from None
        self.decay = decay


def _on_every_rank(
    values: tuple[float, ...], group: dist.ProcessGroup | None
) -> list[tuple[float, ...]]:
    """Every rank's ``values`` by rank (each exact in a float64), gathered over the host
    ``group`` (``None``: one rank). Collective."""
    if group is None:
        return [values]
    gathered = all_gather_numbers(values, torch.device("cpu"), dtype=torch.float64, group=group)
    return [tuple(row) for row in gathered]


def _from_rank0(value: float | None, group: dist.ProcessGroup | None) -> float | None:
    """Rank 0's ``value`` on every rank. Collective."""
    if group is None:
        return value
    sent = torch.tensor([math.nan if value is None else value], dtype=torch.float64)
    dist.broadcast(sent, group=group, group_src=0)
    return None if math.isnan(sent.item()) else sent.item()


def _by_rank(values: list[tuple[float, ...]]) -> str:
    return ", ".join(f"rank {rank}: {value[0]}" for rank, value in enumerate(values))


def _decay_of(state_dict: object) -> float | None:
    """The decay of an EMA state dict, or ``None`` where it is not one."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("weights"), Mapping):
        return None
    return _valid_decay(state_dict.get("decay"))


def _valid_decay(decay: object) -> float | None:
    """``decay`` as a float if it is a number in (0, 1), else ``None``."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        return None
    return float(decay)
