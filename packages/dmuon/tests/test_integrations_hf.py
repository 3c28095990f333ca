"""``dmuon.integrations.hf``: a tiny ``LlamaForCausalLM`` (tied embeddings) trained by
``DmuonTrainer`` on 2 gloo ranks. The loss falls, ``dmuon.Muon`` steps the dedicated matrices,
a checkpoint holds dmuon's sharded checkpoint and the full weights, and a run resumed from it in
a model built from other weights logs the uninterrupted run's later losses and evaluation loss
bit for bit. The shipped classes override no underscored transformers method."""

from __future__ import annotations

import gc
import itertools
import math
import os
import warnings
import weakref

import pytest
import torch

from dmuon_testing.distributed import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GenerationConfig, Trainer, TrainerCallback, TrainingArguments

from dmuon.integrations import hf

VOCAB, SEQ, ROWS_PER_RANK, STEPS, SAVE_AT, MAX_GRAD_NORM = 64, 16, 4, 6, 3, 0.5
# The decoder both test models share (a Llama, a Qwen3-MoE).
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=SEQ + 1,
)


def _plain_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**_TINY, tie_word_embeddings=True))
    model.generation_config.max_new_tokens = 7  # the model's own, which its exports keep
    return model


def _model(seed: int, mesh):
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = _plain_model(seed)
    dmuon.dedicate_params(model, mesh, predicate=lambda name, p: ".layers." in name and p.ndim == 2)
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    return model


def _two_mesh_model(seed: int, mesh):
    """``_model`` with the root's parameters on a second mesh of the same ranks: the
    Trainer finds its gradients on several meshes and clips them without its accelerator."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = _plain_model(seed)
    dmuon.dedicate_params(model, mesh, predicate=lambda name, p: ".layers." in name and p.ndim == 2)
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    root_mesh = init_device_mesh("cpu", (mesh.size(),), mesh_dim_names=("root",))
    fully_shard(model, mesh=root_mesh, ignored_params=dedicated)
    return model


def _moe_model(seed: int, mesh):
    """A transformers 5 Qwen3-MoE (its experts stacked (E, out, in)), every matrix on Muon:
    ``save_pretrained`` writes each expert under its own name."""
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import dmuon

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        **_TINY, moe_intermediate_size=8, head_dim=8, num_experts=4, num_experts_per_tok=2
    )
    model = Qwen3MoeForCausalLM(config)
    dmuon.dedicate_params(model, mesh, lambda name, p: p.ndim >= 2 and ".layers." in name)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rows(world_size: int) -> list[dict[str, torch.Tensor]]:
    """``t[i+1] = (5 t[i] + 3) mod VOCAB`` from a random start: learnable in a few steps."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(STEPS * ROWS_PER_RANK * world_size):
        tokens = [int(torch.randint(0, VOCAB, (), generator=g))]
        for _ in range(SEQ):
            tokens.append((5 * tokens[-1] + 3) % VOCAB)
        rows.append({"input_ids": torch.tensor(tokens), "labels": torch.tensor(tokens)})
    return rows


class _NormAfterClip(TrainerCallback):
    """The norm of every gradient right before each step, after the Trainer's clip (and
    DmuonTrainer's callback)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        import dmuon

        muon = kwargs["optimizer"].optimizer
        self.norms.append(float(dmuon.clip_grad_norm_(muon, None, params="all").total_norm))


def _train(
    root: str,
    name: str,
    seed: int,
    resume: str | None = None,
    build=_model,
    max_grad_norm=MAX_GRAD_NORM,
    earlier: bool = False,
    muon_kwargs=None,
):
    from torch.distributed.device_mesh import init_device_mesh

    args = hf.DmuonTrainingArguments(
        output_dir=os.path.join(root, name),
        use_cpu=True,
        per_device_train_batch_size=ROWS_PER_RANK,
        max_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    mesh = init_device_mesh("cpu", (args.world_size,))
    rows = _rows(args.world_size)
    model = build(seed, mesh)
    earlier_freed = None
    if earlier:
        # A trainer built on the model before this one and dropped (a first attempt, a cell
        # run again): its load hooks stayed on the model, loaded the checkpoint's weights file
        # that this trainer's resume leaves out, and kept it and its optimizer alive.
        dropped = hf.DmuonTrainer(model, args, train_dataset=rows, muon_kwargs={"lr": 0.05})
        dropped.create_optimizer()
        earlier_freed = weakref.ref(dropped)
        del dropped
        gc.collect()
    trainer = hf.DmuonTrainer(
        model,
        args,
        train_dataset=rows,
        eval_dataset=rows[: 2 * ROWS_PER_RANK * args.world_size],
        muon_kwargs={"lr": 0.05, **(muon_kwargs or {})},
    )
    trainer.add_callback(_NormAfterClip())  # after DmuonTrainer's own
    if resume is None:
        # A baseline evaluation first, as usual: it left the root's parameters unsharded, and
        # train() then refused to build dmuon.Muon ('neither dedicated nor managed by FSDP2').
        trainer.evaluate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    trainer.warned = [
        (str(w.message), w.filename) for w in caught if "ns_overlap" in str(w.message)
    ]
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    trainer.grad_norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    trainer.clipped_norms = next(
        c.norms for c in trainer.callback_handler.callbacks if isinstance(c, _NormAfterClip)
    )
    trainer.earlier_freed = None if earlier_freed is None else earlier_freed() is None
    return trainer, losses, trainer.evaluate()["eval_loss"]


def _train_save_resume(rank: int, world_size: int, root: str) -> dict:
    import dmuon

    # What torchrun sets, and accelerate reads to join the process group the pool started.
    for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size}.items():
        os.environ[key] = str(value)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)

    # ns_overlap: the Trainer's clip stops it at the first step (same bits), with a warning.
    overlap = {"options": dmuon.StepOptions(ns_overlap=True)}
    trainer, losses, eval_loss = _train(root, "run", seed=0, muon_kwargs=overlap)
    muon = trainer.muon
    optimizer_state = dmuon.get_optimizer_state_dict(trainer.model, muon, rank0_only=True)
    trained = dmuon.get_model_state_dict(trainer.model, rank0_only=True)
    # accelerate's clip of model.parameters() (the Trainer's for max_grad_norm): the trainer's
    # accelerator takes every gradient by one norm; another refuses the dedicated weights (it
    # took the FSDP2 gradients alone, and left the Muon ones unclipped).
    from accelerate import Accelerator

    ids = torch.stack([row["input_ids"] for row in _rows(world_size)[:ROWS_PER_RANK]])
    trainer.model(input_ids=ids, labels=ids).loss.backward()
    every = float(dmuon.clip_grad_norm_(muon, None, params="all").total_norm)
    routed = float(trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), math.inf))
    plain = Accelerator(cpu=True)
    try:
        plain.clip_grad_norm_(trainer.model.parameters(), math.inf)
        refused = ""
    except ValueError as error:
        refused = str(error)
    held = dmuon.dedicated_params_of(trainer.model)
    fsdp2 = [p for p in trainer.model.parameters() if p not in held]  # accelerate's own clip
    adamw = (
        float(plain.clip_grad_norm_(fsdp2, math.inf)),
        float(dmuon.clip_grad_norm_(muon, None, params="adamw").total_norm),
    )
    trainer.model.zero_grad()

    # The user's own param_groups: args.weight_decay (0.1) is the decay of each group that
    # sets none (it was dropped for dmuon.Muon's defaults: Muon's 0, AdamW's 0.01).
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    custom = hf.dmuon_optimizer(
        trainer.model,
        trainer.args,
        param_groups=[
            {"group_name": "body", "params": [(n, p) for n, p in named if "norm" not in n]},
            {
                "group_name": "norms",
                "params": [(n, p) for n, p in named if "norm" in n],
                "weight_decay": 0.0,
            },
        ],
    )
    custom_decay = {g["group_name"]: g["weight_decay"] for g in custom.param_groups}
    del custom

    checkpoint = os.path.join(root, "run", f"checkpoint-{SAVE_AT}")
    second, resumed, resumed_eval_loss = _train(root, "resumed", seed=1, resume=checkpoint)
    # model.load_state_dict of the checkpoint's full weights (tied: lm_head.weight is not in
    # the file), as the Trainer's resume calls it, puts exactly those weights in the model.
    from safetensors.torch import load_file

    exported = load_file(os.path.join(checkpoint, "model.safetensors"))
    loaded = second.model.load_state_dict(exported, strict=False)
    reread = dmuon.get_model_state_dict(second.model, rank0_only=True)
    if rank != 0:
        return {}
    names = muon.muon_param_names()
    initial = _plain_model(seed=0).state_dict()  # what the first run started from
    state = optimizer_state["state"]
    return {
        "optimizer": type(muon).__name__,
        "groups": {
            g["group_name"]: (g["weight_decay"], set(g["param_names"])) for g in muon.param_groups
        },
        "decay_names": set(trainer.get_decay_parameter_names(trainer.model)),
        "custom_decay": custom_decay,
        "clip": (every, routed, refused, adamw),
        "grad_norms": (trainer.grad_norms, trainer.clipped_norms),
        "warned": trainer.warned,
        "muon_names": names,
        "momentum": {n: float(state[n]["momentum_buffer"].norm()) for n in names},
        "moved": {n: not torch.equal(initial[n], trained[n]) for n in names},
        "losses": losses,
        "eval_loss": eval_loss,
        "resumed": resumed,
        "resumed_eval_loss": resumed_eval_loss,
        "files": sorted(os.listdir(checkpoint)),
        "generation": GenerationConfig.from_pretrained(checkpoint).max_new_tokens,
        "exported": sorted(exported),
        "load_result": (loaded.missing_keys, loaded.unexpected_keys),
        "reloaded": all(torch.equal(reread[n], v) for n, v in exported.items())
        and torch.equal(reread["lm_head.weight"], exported["model.embed_tokens.weight"]),
    }


@pytest.mark.distributed
def test_trainer_trains_checkpoints_and_resumes_bit_for_bit(tmp_path) -> None:
    out = run_distributed(_train_save_resume, 2, str(tmp_path))[0]
    assert out["optimizer"] == "Muon"
    # Muon steps every dedicated matrix: 14 = 2 layers x (4 attention + 3 MLP) projections.
    assert len(out["muon_names"]) == 14
    assert all(out["momentum"][n] > 0 for n in out["muon_names"]), out["momentum"]
    assert all(out["moved"].values()), out["moved"]
    # The Trainer's weight_decay=0.1 on its decay parameters, Muon's matrices included, and
    # none on the norms (it used to reach the AdamW parameters alone, norms included).
    groups, decay_names = out["groups"], out["decay_names"]
    assert groups["decay/muon"] == (0.1, set(out["muon_names"]))
    assert groups["decay/adamw"] == (0.1, {"model.embed_tokens.weight"})
    assert groups["no_decay/muon"] == (0.0, set())
    assert groups["no_decay/adamw"][0] == 0.0
    assert groups["no_decay/adamw"][1] and all("norm" in n for n in groups["no_decay/adamw"][1])
    assert groups["decay/muon"][1] | groups["decay/adamw"][1] <= decay_names
    every, routed, refused, (fsdp2, adamw) = out["clip"]
    assert fsdp2 == pytest.approx(adamw, rel=1e-6) and fsdp2 < every
    assert routed == pytest.approx(every, rel=1e-6), (routed, every)
    assert "dmuon.clip_grad_norm_(muon, max_norm, params='all')" in refused, refused
    # The Trainer's max_grad_norm (0.5) clipped every gradient by one norm, the logged one:
    # right before each step their norm is min(logged, 0.5) (each kind was clipped by its own
    # norm, which left up to 0.5 * sqrt(2)).
    logged, clipped = out["grad_norms"]
    assert len(clipped) == STEPS and any(n > MAX_GRAD_NORM for n in logged), logged
    assert clipped == pytest.approx([min(n, MAX_GRAD_NORM) for n in logged], rel=1e-5)
    # The clip stopped ns_overlap with one warning, at the user's trainer.train() line (it
    # named the Trainer's loop in transformers).
    ((message, filename),) = out["warned"]
    assert "ns_overlap=True) is off" in message and filename == __file__, out["warned"]
    assert out["custom_decay"] == {
        "body/muon": 0.1,
        "body/adamw": 0.1,
        "norms/muon": 0.0,
        "norms/adamw": 0.0,
    }
    losses = [out["losses"][step] for step in range(1, STEPS + 1)]
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < losses[0] - 0.3, (
        losses
    )
    # The checkpoint: dmuon's sharded one, the full weights, no rank-0 optimizer file.
    assert {"dmuon", "model.safetensors", "scheduler.pt", "trainer_state.json"} <= set(out["files"])
    assert "optimizer.pt" not in out["files"]
    # The model's generation_config (it wrote one made from the config: max_new_tokens None).
    assert out["generation"] == 7
    assert "lm_head.weight" not in out["exported"] and out["load_result"] == ([], [])
    assert out["reloaded"]
    # Resumed from other initial weights: the later steps as without the checkpoint.
    later = {step: loss for step, loss in out["losses"].items() if step > SAVE_AT}
    assert {s: v for s, v in out["resumed"].items() if s > SAVE_AT} == later
    assert out["resumed_eval_loss"] == out["eval_loss"]


def _moe_resume(rank: int, world_size: int, root: str) -> dict:
    for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size}.items():
        os.environ[key] = str(value)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    # max_grad_norm=inf: the Trainer's clip scales nothing, and neither may the dedicated
    # weights' (it used to raise at the first step: dmuon's clip takes a finite max_norm).
    first, losses, _ = _train(root, "moe", seed=0, build=_moe_model, max_grad_norm=math.inf)
    checkpoint = os.path.join(root, "moe", f"checkpoint-{SAVE_AT}")
    second, resumed, _ = _train(
        root,
        "moe-resumed",
        seed=1,
        resume=checkpoint,
        build=_moe_model,
        max_grad_norm=math.inf,
        earlier=True,
    )
    # Gradients on two meshes, max_grad_norm=0.5: the Trainer clips them by their own norm,
    # without its accelerator.
    two_mesh, _, _ = _train(root, "two-mesh", seed=0, build=_two_mesh_model)
    return {
        "losses": losses,
        "resumed": resumed,
        "grad_norms": first.grad_norms,
        "earlier_freed": second.earlier_freed,
        "two_mesh": (two_mesh.grad_norms, two_mesh.clipped_norms),
    }


@pytest.mark.distributed
def test_a_mixture_of_experts_run_resumes_bit_for_bit(tmp_path) -> None:
    # The checkpoint's weights file names each expert apart (save_pretrained), the model holds
    # them stacked: the resume takes the weights from the dmuon checkpoint instead.
    # The resumed run's model had a trainer built on it first (its hooks loaded the weights
    # file: 'set_model_state_dict: missing key(s)'), which must be freed once dropped.
    out = run_distributed(_moe_resume, 2, str(tmp_path))[0]
    later = {step: loss for step, loss in out["losses"].items() if step > SAVE_AT}
    assert later and {s: v for s, v in out["resumed"].items() if s > SAVE_AT} == later
    assert out["earlier_freed"]
    # Measured, not clipped: every step logs a finite norm of every gradient.
    norms = out["grad_norms"]
    assert len(norms) == STEPS and all(0 < n < math.inf for n in norms), norms
    # Every gradient by one norm, the logged one, as on one mesh (the Trainer's clip and the
    # dedicated weights' each scaled their own kind by its norm: 0.511 at the first step).
    logged, clipped = out["two_mesh"]
    assert len(clipped) == STEPS and any(n > MAX_GRAD_NORM for n in logged), logged
    assert clipped == pytest.approx([min(n, MAX_GRAD_NORM) for n in logged], rel=1e-5)


def test_the_default_decay_rule_is_the_trainers() -> None:
    # dmuon_optimizer without a Trainer decays what Trainer.get_decay_parameter_names names.
    model = _plain_model(seed=0)
    groups = hf._decay_groups(model, None)
    trainer_rule = set(Trainer.get_decay_parameter_names(None, model))  # reads no Trainer state
    names = {n for n, _ in model.named_parameters()}
    assert {n for n, _ in groups[0]["params"]} == trainer_rule & names
    assert {n for n, _ in groups[1]["params"]} == names - trainer_rule


def test_no_underscored_transformers_method_is_overridden() -> None:
    shipped = [
        cls for cls in vars(hf).values() if isinstance(cls, type) and cls.__module__ == hf.__name__
    ]
    overridden: dict[str, set[str]] = {}
    for cls in shipped:
        for base in (Trainer, TrainerCallback, TrainingArguments):
            if not issubclass(cls, base):
                continue
            own = {name for klass in cls.__mro__[: cls.__mro__.index(base)] for name in vars(klass)}
            overridden[cls.__name__] = {name for name in own if hasattr(base, name)}
    assert set(overridden) == {"DmuonTrainer", "DmuonTrainingArguments", "_DmuonEvents"}
    private = {
        cls: sorted(n for n in names if n.startswith("_") and not n.endswith("__"))
        for cls, names in overridden.items()
    }
    assert not any(private.values()), private
    # The public hooks it relies on are still the Trainer's.
    assert {"__init__", "create_optimizer", "training_step", "train", "save_model", "log"} <= (
        overridden["DmuonTrainer"]
    )
    assert overridden["DmuonTrainingArguments"] >= {"__post_init__", "place_model_on_device"}


def test_the_trainers_overrides_return_what_the_trainers_methods_declare() -> None:
    # A user's type checker reads DmuonTrainer's annotations: train() said Any where
    # Trainer.train says TrainOutput.
    import typing

    for name in ("train", "training_step", "create_optimizer", "save_model", "log"):
        ours = typing.get_type_hints(getattr(hf.DmuonTrainer, name))["return"]
        base = getattr(Trainer, name)  # its other hints name optuna, which may be missing
        theirs = base.__annotations__.get("return", ours)
        if isinstance(theirs, str):
            theirs = eval(theirs, base.__globals__)
        theirs = type(None) if theirs is None else theirs
        assert ours == theirs, (name, ours, theirs)


def test_bad_arguments_name_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match="unset torch_compile"):
        hf.DmuonTrainingArguments(output_dir=str(tmp_path), use_cpu=True, torch_compile=True)
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(TypeError, match="DmuonTrainingArguments"):
        hf.DmuonTrainer(torch.nn.Linear(2, 2), plain)
    args = hf.DmuonTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"dmuon\.dedicate_params"):
        hf.DmuonTrainer(torch.nn.Linear(2, 2), args)
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(ValueError, match="holds no dmuon checkpoint"):
        hf._checkpoint_to_resume(str(tmp_path / "checkpoint-3"), str(tmp_path))
    # dmuon/ without the Trainer's scheduler.pt: refused before any weight is loaded (the
    # schedule was read after dmuon.load_checkpoint: FileNotFoundError, the model replaced).
    (tmp_path / "checkpoint-3" / "dmuon").mkdir()
    (tmp_path / "checkpoint-3" / "dmuon" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds no scheduler\.pt"):
        hf._checkpoint_to_resume(str(tmp_path / "checkpoint-3"), str(tmp_path))
    with pytest.raises(ValueError, match="no checkpoint-N folder"):
        hf._checkpoint_to_resume(True, str(tmp_path / "absent"))
