"""Train, checkpoint and resume dmuon with torchtitan 0.3's llama3 and its components.

    python docs/examples/integrations/torchtitan_train.py             # 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 docs/examples/integrations/torchtitan_train.py --dir /shared/ckpt
    torchrun --nproc-per-node 1 docs/examples/integrations/torchtitan_train.py --device cuda

The recipe is the first half of this file, three pieces a torchtitan job plugs in through its
``Trainer.Config``: :func:`parallelize_llama_dmuon` (torchtitan's ``parallelize_llama`` with
``dmuon.dedicate_params`` between tensor parallelism and FSDP2, registered as the
``ModelSpec``'s ``parallelize_fn``), :class:`DmuonOptimizersContainer` (one ``dmuon.Muon``
behind torchtitan's optimizer container, which its LR scheduler wraps) and
:class:`DmuonCheckpointManager` (torchtitan's DCP checkpointer with the model and the
optimizer in one ``dmuon.AppState``). :func:`llama3_debugmodel_dmuon` is torchtitan's own
``llama3_debugmodel`` job with the three swapped in, for
``torchrun ... -m torchtitan.train --module torchtitan_train --config llama3_debugmodel_dmuon``
on GPUs (this directory on ``PYTHONPATH``, run from a torchtitan checkout for its test
tokenizer and data).

torchtitan's ``Trainer`` cannot start on a machine without an accelerator (it picks CUDA and
NCCL when it finds none, ``torchtitan/tools/utils.py`` line 55, and calls
``torch.cuda.set_device`` at ``torchtitan/trainer.py`` line 301). So the second half runs the
same config through the same calls as ``Trainer.__init__``, ``Trainer.train`` and
``Trainer.train_step``, in a short loop of its own, on gloo (or, with ``--device cuda`` under
``torchrun``, on NCCL and the GPUs): build the two-layer debug model on the meta device,
``parallelize_fn``, ``to_empty``, ``init_weights``, the optimizer, LR-scheduler and checkpoint
builders, then 10 steps with a checkpoint at step 5. It then builds everything
again from other initial weights, resumes from step 5 with ``checkpointer.load`` and exits
non-zero unless the loss fell and the resumed steps' losses equal the uninterrupted run's bit
for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from torch import Tensor, nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.checkpoint import MODEL, OPTIMIZER, CheckpointManager
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.attention import (
    FusedQKVLinear,
    QKVLinear,
    ScaledDotProductAttention,
)
from torchtitan.models.common.linear import Linear
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

# The quickstart's data task and launcher (docs/examples/train_fsdp.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_fsdp import batch, launch

import dmuon

STEPS, SAVE_AT = 10, 5


# ---------------------------------------------------------------------------------------------
# The recipe: what a torchtitan job needs to train with dmuon.


def muon_matrices(name: str, param: nn.Parameter) -> bool:
    """The Muon matrices: every 2-D weight of the transformer blocks (attention ``wqkv``, ``wo``
    and feed-forward ``w1``, ``w2``, ``w3``); the embedding, the output head and the norms stay
    with FSDP2 and AdamW."""
    return name.startswith("layers.") and param.ndim == 2


def separate_qkv(fused: FusedQKVLinear.Config) -> QKVLinear.Config:
    """torchtitan's separate ``wq``, ``wk``, ``wv`` projections (``QKVLinear``) in place of a
    fused ``wqkv`` (``FusedQKVLinear``, what torchtitan's llama3 configs build).

    [Note: separate q, k and v]
    Muon orthogonalises each matrix it steps, and q, k and v are three matrices: stacked in
    one ``wqkv`` they would be orthogonalised as one (and dmuon's QK-clip would need row maps).
    The fused module also saves its weight as ``wq``/``wk``/``wv`` through a state-dict hook
    that reshapes it, a read of the whole weight on every rank, which dmuon refuses where the
    weight is not held. The separate module has those keys natively, so checkpoints keep
    torchtitan's names. The initialisation is llama3's for each of the three (a truncated
    normal, std 0.02), as the fused one draws it slice by slice."""
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
    dim, head_dim = fused.wqkv.in_features, fused.head_dim
    return QKVLinear.Config(
        head_dim=head_dim,
        wq=Linear.Config(in_features=dim, out_features=fused.n_heads * head_dim, param_init=init),
        wkv=Linear.Config(
            in_features=dim, out_features=fused.n_kv_heads * head_dim, param_init=init
        ),
    )


def parallelize_llama_dmuon(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """torchtitan's ``parallelize_llama`` (models/llama3/parallelize.py) with dmuon: tensor
    parallelism, activation checkpointing, ``dmuon.dedicate_params``, per-block compile, then
    torchtitan's own ``apply_fsdp_to_decoder``.

    [Note: where dmuon goes in torchtitan's parallelize]
    ``dedicate_params`` must see the weights as FSDP2 will leave them: after tensor parallelism
    (a TP weight is a DTensor on the ``tp`` mesh, which dmuon shards by owner as it is) and
    after activation checkpointing (its wrapper renames the parameters, and dmuon keys its
    checkpoints by the names it saw), and before any ``fully_shard``. ``apply_fsdp_to_decoder``
    calls ``fully_shard`` without ``ignored_params`` (distributed/fsdp.py), so it relies on the
    patch ``dedicate_params`` installs by default (``patch_fully_shard=True``, spelled out
    below): every ``fully_shard`` then leaves the dedicated matrices alone, and torchtitan's
    FSDP2 setup (mixed precision, the reshard policy, its
    gradient scaling, HSDP on a ``dp_replicate`` axis) stays exactly its own. The dmuon mesh is
    torchtitan's ``fsdp`` axis, with ``dp_replicate`` as the replicate mesh under HSDP.
    """
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelize_llama_dmuon needs parallelism.spmd_backend='partial_dtensor', got "
            f"{parallelism.spmd_backend!r}: under 'spmd_types' and 'full_dtensor' fully_shard "
            "shards over torchtitan's whole SPMD mesh, which dmuon does not take"
        )
    unsupported = [
        name
        for name, on in (
            ("context parallelism", parallel_dims.cp_enabled),
            ("pipeline parallelism", parallel_dims.pp_enabled),
            ("expert parallelism", parallel_dims.ep_enabled),
        )
        if on
    ]
    if unsupported:
        raise ValueError(
            f"parallelize_llama_dmuon supports FSDP, HSDP and tensor parallelism, not "
            f"{', '.join(unsupported)}: set their degrees to 1"
        )
    if parallel_dims.tp_enabled:
        model.parallelize(parallel_dims)  # type: ignore[operator]  # torchtitan's Module
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)

    dp_axes = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dmuon.dedicate_params(
        model,
        parallel_dims.get_mesh("fsdp"),
        muon_matrices,
        replicate_mesh=(
            parallel_dims.get_mesh("dp_replicate") if parallel_dims.dp_replicate_enabled else None
        ),
        patch_fully_shard=True,
    )

    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    apply_fsdp_to_decoder(
        model,  # type: ignore[arg-type]  # a torchtitan Decoder
        parallel_dims.get_mesh(dp_axes),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=False,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    return model


class DmuonOptimizersContainer(OptimizersContainer):
    """One ``dmuon.Muon`` (Muon for the dedicated matrices, AdamW for the rest) behind
    torchtitan's ``OptimizersContainer``: ``LRSchedulersContainer`` wraps each optimizer it
    iterates (this one) in a ``LambdaLR``, which scales both groups' ``lr``.

    [Note: Muon gradients in torchtitan]
    torchtitan divides each rank's summed loss by the global token count and turns off FSDP2's
    gradient division (``disable_fsdp_gradient_division`` sets ``set_gradient_divide_factor(1.0)``
    on every ``fully_shard`` module), so an FSDP2 gradient is the sum over the data-parallel
    ranks. dmuon follows that factor: the Muon gradients are sums too. ``Trainer.train_step``
    clips FSDP2's gradients (``training.max_norm``, expert stacks included) and never sees those
    of the dedicated weights, which :meth:`step` clips at ``muon_max_norm``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 0.02
        """Muon learning rate (the dedicated matrices)."""

        weight_decay: float = 0.0
        """Muon decoupled weight decay."""

        adamw_lr: float = 8e-4
        """AdamW learning rate (embedding, output head, norms)."""

        adamw_betas: tuple[float, float] = (0.9, 0.95)
        adamw_weight_decay: float = 0.1
        adamw_eps: float = 1e-8

        muon_max_norm: float | None = 1.0
        """Clip the dedicated weights' gradients to this global norm (on torchtitan's gradient
        scale); ``None`` leaves them unclipped."""

        muon_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Any other ``dmuon.Muon`` argument (``momentum``, ``ns_steps``,
        ``options=dmuon.StepOptions(lr_scaling=...)``...)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ValueError(
                f"DmuonOptimizersContainer takes one model part, got {len(model_parts)}: "
                "pipeline parallelism is not supported"
            )
        if config.param_groups:
            raise ValueError(
                "DmuonOptimizersContainer.Config.param_groups must stay empty: dmuon.Muon routes "
                "the parameters itself (dedicated matrices to Muon, the rest to AdamW); pass "
                "Muon's own param_groups through muon_kwargs"
            )
        (model,) = model_parts
        self.model_parts = model_parts
        self.muon = dmuon.Muon(
            model,
            lr=config.lr,
            weight_decay=config.weight_decay,
            adamw_lr=config.adamw_lr,
            adamw_betas=config.adamw_betas,
            adamw_weight_decay=config.adamw_weight_decay,
            adamw_eps=config.adamw_eps,
            **config.muon_kwargs,
        )
        self.optimizers = [self.muon]
        self.muon_max_norm = config.muon_max_norm
        # torchtitan clips every param.grad; the dedicated weights' gradients are not there.
        self.held = dmuon.dedicated_params_of(model)
        # Optimizer.__init__, as OptimizersContainer does, for the step hooks it registers.
        self._post_init(list(model.parameters()))

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("DmuonOptimizersContainer.step takes no closure, as torchtitan's")
        if self.muon_max_norm is not None:
            dmuon.clip_grad_norm_(self.muon, self.muon_max_norm, params=self.held)
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise TypeError(NOT_ALONE)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError(NOT_ALONE)


NOT_ALONE = (
    "DmuonOptimizersContainer is checkpointed together with the model, in one dmuon.AppState, "
    "by DmuonCheckpointManager: set the job's checkpoint=DmuonCheckpointManager.Config(...)"
)


class DmuonCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` with the model and its ``dmuon.Muon`` in one
    ``dmuon.AppState`` under ``"dmuon"``, beside the LR scheduler, the dataloader and the train
    state, which it saves and loads as it always does.

    [Note: torchtitan checkpoints]
    ``CheckpointManager`` puts a ``ModelWrapper`` (``model.state_dict()``, which reads every
    weight on every rank and so raises ``dmuon.NotHeldError`` on a dedicated matrix) and the
    optimizer container into the dictionary it hands to ``dcp.save`` / ``dcp.load``. Here the
    wrapper wraps no module (its part of the dictionary is empty) and the container's place is
    taken by ``dmuon.AppState``, which gives DCP what each rank holds: its FSDP2 shards, and on
    its owner a dedicated matrix's weight and momentum. The keys are those of
    ``dmuon.save_checkpoint`` (``dmuon.model.<fqn>``, ``dmuon.optim...``), so a step folder
    loads on another world size or HSDP shape as any dmuon checkpoint does. A model-only save
    or load would find the wrapper empty: the config refuses those options.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        last_save_model_only: bool = False
        """Must stay False: the last checkpoint is a full one (dmuon has no model-only
        DCP layout)."""

        initial_load_model_only: bool = False
        """Without ``initial_load_path`` (refused below) it has no effect."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            refused = [
                name
                for name, on in (
                    ("last_save_model_only", self.last_save_model_only),
                    ("last_save_in_hf", self.last_save_in_hf),
                    ("initial_load_path", self.initial_load_path is not None),
                    ("create_seed_checkpoint", self.create_seed_checkpoint),
                )
                if on
            ]
            if refused:
                raise ValueError(
                    f"DmuonCheckpointManager saves and loads the model and the optimizer "
                    f"together, in one dmuon.AppState: unset {', '.join(refused)}. Export "
                    "weights with dmuon.get_model_state_dict(model, rank0_only=True); start "
                    "from saved weights with dmuon.set_model_state_dict or "
                    "dmuon.load_checkpoint after the job's model is built"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: OptimizersContainer,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        if not isinstance(optimizers, DmuonOptimizersContainer):
            raise TypeError(
                f"DmuonCheckpointManager checkpoints a DmuonOptimizersContainer, got "
                f"{type(optimizers).__name__}: set the job's optimizer="
                "DmuonOptimizersContainer.Config(...)"
            )
        (model,) = model_parts
        super().__init__(
            config,
            dataloader=dataloader,
            model_parts=[],
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        if self.enable:
            assert not self.states[MODEL].state_dict()  # wraps no module: see the Note above
            del self.states[OPTIMIZER]
            self.states[dmuon.runtime.CHECKPOINT_KEY] = dmuon.AppState(model, optimizers.muon)


def llama3_debugmodel_dmuon() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` job (models/llama3/config_registry.py) on dmuon: the
    three pieces above, separate q/k/v projections and the ``partial_dtensor`` SPMD backend
    they need."""
    config = llama3_debugmodel()
    assert config.model_spec is not None
    for layer in config.model_spec.model.layers:
        layer.attention.qkv_linear = separate_qkv(layer.attention.qkv_linear)
    config.model_spec.parallelize_fn = parallelize_llama_dmuon
    config.model_spec.pipelining_fn = None
    config.parallelism.spmd_backend = "partial_dtensor"
    config.optimizer = DmuonOptimizersContainer.Config(lr=0.02, adamw_lr=8e-4)
    config.checkpoint = DmuonCheckpointManager.Config(interval=10)
    return config


# ---------------------------------------------------------------------------------------------
# The run: torchtitan's Trainer steps, on the CPU.


def small_config(directory: str, resume_from: int | None) -> Trainer.Config:
    """The job above, shrunk to run on CPU ranks as well as GPUs: two transformer blocks, SDPA
    attention (torchtitan's language-model attentions, FlexAttention and varlen, are compiled
    or CUDA kernels), 16 tokens a row, checkpoints every ``SAVE_AT`` steps into
    ``directory``."""
    config = llama3_debugmodel_dmuon()
    assert config.model_spec is not None
    model = config.model_spec.model
    model.layers = model.layers[:2]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.loss = CrossEntropyLoss.Config()
    config.dump_folder = directory
    config.training.seq_len = 16
    config.training.local_batch_size = 4
    config.training.steps = STEPS
    config.training.disable_cuda_graphs = True
    config.checkpoint = DmuonCheckpointManager.Config(
        enable=True,
        interval=SAVE_AT,
        load_step=-1 if resume_from is None else resume_from,
        load_only=resume_from is not None,  # the resumed run leaves the first run's folders
    )
    return config


class Batches(Stateful):
    """This rank's batches of the quickstart's learnable task on ``device``, a new one each
    step; its position is checkpointed, as torchtitan's dataloader's is."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device, self.taken = rank, world_size, device, 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            tokens = batch(self.taken * self.world_size + self.rank, self.device)
            self.taken += 1
            yield tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.taken = state_dict["taken"]


class TrainState(Stateful):
    """``Trainer``'s own entry in the checkpoint (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def parallel_dims_on(config: Trainer.Config, device: torch.device) -> ParallelDims:
    """``Trainer.init_distributed``'s ``ParallelDims``, its meshes on ``device``'s type:
    torchtitan builds them on ``tools.utils.device_type``, which is ``"cuda"`` also on a
    machine without an accelerator (tools/utils.py line 55)."""
    titan_parallel_dims.device_type = device.type  # type: ignore[attr-defined]
    return ParallelDims.from_config(config.parallelism, dist.get_world_size())


def sum_gradients_on_gloo(model: nn.Module) -> None:
    """FSDP2 divides gradients by the factor torchtitan sets (1) with ``PREMUL_SUM``, which
    gloo lacks; a plain sum is the same with a factor of 1. NCCL has it: nothing to do."""
    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def run(config: Trainer.Config, seed: int, device: torch.device) -> dict[int, float]:
    """``Trainer.__init__`` and ``Trainer.train`` for ``config`` on this rank, on ``device``;
    returns the loss of every step it trained (the sum over ranks of each rank's share, as the
    Trainer logs)."""
    assert config.model_spec is not None
    parallel_dims = parallel_dims_on(config, device)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model = config.model_spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=config.dump_folder,
    )
    sum_gradients_on_gloo(model)
    model.to_empty(device=device)
    torch.manual_seed(seed)  # the same initial weights on every rank
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    loss_fn = config.loss.build(compile_config=config.compile)
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(
        optimizers=optimizers, training_steps=config.training.steps
    )
    data = Batches(dist.get_rank(), dist.get_world_size(), device)
    state = TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=config.dump_folder,
    )
    train_context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims, spmd_typechecking=False
    )

    checkpointer.load(step=config.checkpoint.load_step)
    # None on one rank: the sums below then reduce nothing, as the Trainer's do without DP.
    batch_mesh = parallel_dims.get_optional_mesh("batch")
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    batches = iter(data)
    losses = {}
    try:
        while state.step < config.training.steps:
            state.step += 1
            # Trainer.train_step, with one micro-batch.
            optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
            inputs, labels = next(batches)
            global_valid_tokens = dist_utils.dist_sum_tensor(
                (labels != IGNORE_INDEX).sum(), batch_mesh
            )
            with train_context():
                loss, _ = loss_fn(model(inputs), labels, global_valid_tokens)
                loss.backward()
            dist_utils.clip_grad_norm_(
                list(model.parameters()), config.training.max_norm, foreach=True
            )
            optimizers.step()
            lr_schedulers.step()
            losses[state.step] = dist_utils.dist_sum(loss.detach(), loss_mesh)
            checkpointer.save(state.step, last_step=state.step == config.training.steps)
    finally:
        checkpointer.close()
    return losses


def train_and_resume(directory: str | None, device_type: str = "cpu") -> None:
    if directory is None:  # one temporary directory for all ranks, rank 0's
        made = [tempfile.mkdtemp(prefix="dmuon-torchtitan-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(made, src=0)
        try:
            train_and_resume(str(made[0]), device_type)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(str(made[0]))
        return
    device = torch.device(
        device_type, torch.cuda.current_device() if device_type == "cuda" else None
    )
    uninterrupted = run(small_config(directory, resume_from=None), seed=0, device=device)
    # Resume: other initial weights, which the checkpoint must replace.
    resumed = run(small_config(directory, resume_from=SAVE_AT), seed=1, device=device)
    if dist.get_rank() != 0:
        return
    first = [uninterrupted[s] for s in sorted(uninterrupted)]
    print("losses", " ".join(f"{x:.4f}" for x in first), flush=True)
    if not all(math.isfinite(x) for x in first) or first[-1] >= first[0]:
        raise SystemExit(f"FAILED: the loss did not fall: {first}")
    want = {s: x for s, x in uninterrupted.items() if s > SAVE_AT}
    if resumed != want:
        raise SystemExit(
            f"FAILED: the resumed run's losses {resumed} differ from the uninterrupted run's {want}"
        )
    print(
        f"OK: loss {first[0]:.4f} -> {first[-1]:.4f} in {len(first)} steps; resumed from step"
        f" {SAVE_AT} in {directory}, losses {list(resumed.values())} as without the checkpoint",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to spawn when not under torchrun"
    )
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, under torchrun"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and "RANK" not in os.environ:
        raise SystemExit(
            "--device cuda runs under torchrun, one rank per GPU: torchrun --nproc-per-node N"
            f" {__file__} --device cuda"
        )
    launch(partial(train_and_resume, args.dir, args.device), args.world_size)


if __name__ == "__main__":
    sys.exit(main())
