"""The cluster and the sharding settings a forecast is for."""

from __future__ import annotations

from dataclasses import dataclass

from dmuon_ownership import normalize_dtype

__all__ = ["TP_NS_MODES", "Topology"]

TP_NS_MODES = ("auto", "gather", "gram")


def _positive_int(where: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Topology: {where} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Topology:
    """The cluster and the sharding settings a forecast is for.

    Dtypes are given by name (``"bf16"``/``"bfloat16"``, ``"fp16"``/``"float16"``/``"half"``,
    ``"fp32"``/``"float32"``/``"float"``) or as a torch dtype; another value raises
    ``ValueError``.

    Args:
        ranks: the ranks in all, an int >= 1 and a multiple of ``tp``.
        shard_size: the FSDP2 / dmuon shard group, an int >= 1 that divides ``ranks / tp``
            (HSDP: ``replicas = ranks / (tp · shard_size)``); ``None``: every data-parallel
            rank in one shard group.
        tp: the tensor-parallel degree, an int >= 1.
        zero: 3 (``reshard_after_forward=True``: weights freed after forward and gathered
            again for backward) or 2 (kept from forward to backward).
        param_dtype: what forward computes in and broadcasts carry.
        master_dtype: the weights the optimizer updates (and the dtype the model is built in).
        optim_dtype: the optimizer states' dtype; ``None``: the master dtype.
        reduce_dtype: what gradients are summed in; ``None``: the param dtype, FSDP2's rule.
        tp_ns: how Newton–Schulz runs on a tensor-parallel matrix, as ``StepOptions(tp_ns=)``
            runs it: ``"auto"`` (its default), ``"gather"`` or ``"gram"``.
    """

    ranks: int
    shard_size: int | None = None
    tp: int = 1
    zero: int = 3
    param_dtype: str = "bfloat16"
    master_dtype: str = "float32"
    optim_dtype: str | None = None
    reduce_dtype: str | None = None
    tp_ns: str = "auto"

    def __post_init__(self) -> None:
        ranks = _positive_int("ranks", self.ranks)
        tp = _positive_int("tp", self.tp)
        if ranks % tp:
            raise ValueError(
                f"Topology: ranks={ranks} is not a multiple of tp={tp}; the world is tp "
                "data-parallel grids of equal size"
            )
        shard = ranks // tp if self.shard_size is None else self.shard_size
        shard = _positive_int("shard_size", shard)
        if (ranks // tp) % shard:
            raise ValueError(
                f"Topology: shard_size={shard} does not divide the {ranks // tp} data-parallel "
                f"ranks (ranks / tp); HSDP needs replicas x shard_size = ranks / tp"
            )
        if self.zero not in (2, 3):
            raise ValueError(
                f"Topology: zero must be 2 (weights kept from forward to backward) or 3 "
                f"(resharded after forward), got {self.zero!r}"
            )
        if self.tp_ns not in TP_NS_MODES:
            raise ValueError(
                f"Topology: tp_ns must be one of {list(TP_NS_MODES)} (StepOptions' tp_ns), got "
                f"{self.tp_ns!r}"
            )
        object.__setattr__(self, "shard_size", shard)
        for name in ("param_dtype", "master_dtype"):
            value = normalize_dtype(getattr(self, name), f"Topology: {name}")
            if value is None:
                raise ValueError(f"Topology: {name} needs a dtype, got None")
            object.__setattr__(self, name, value)
        optim = normalize_dtype(self.optim_dtype, "Topology: optim_dtype")
        reduce = normalize_dtype(self.reduce_dtype, "Topology: reduce_dtype")
        object.__setattr__(self, "optim_dtype", optim or self.master_dtype)
        object.__setattr__(self, "reduce_dtype", reduce or self.param_dtype)

    @property
    def shard(self) -> int:
        assert self.shard_size is not None
        return self.shard_size

    @property
    def replicas(self) -> int:
        return self.ranks // (self.tp * self.shard)

    def describe(self) -> str:
        layout = (
            f"{self.replicas} replicas x {self.shard} shards (HSDP)"
            if self.replicas > 1
            else f"{self.shard} shards"
        )
        return (
            f"{self.ranks} ranks = {layout}, TP {self.tp}"
            f"{f' (NS: {self.tp_ns})' if self.tp > 1 else ''}, ZeRO-{self.zero}; param "
            f"{self.param_dtype}, master {self.master_dtype}, optim {self.optim_dtype}, reduce "
            f"{self.reduce_dtype}"
        )
