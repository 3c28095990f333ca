"""The Hugging Face export recipe of the README: train a tiny ``LlamaForCausalLM`` with dmuon
(its ``*_proj`` matrices dedicated, layers ``model.layers.N`` under FSDP2), take
``get_model_state_dict(rank0_only=True)``, ``save_pretrained``, reload with
``from_pretrained``: the same weights and the same logits, with and without tied embeddings.
PEFT LoRA adapters train and save; ``generate()`` between steps, with Hugging Face's gradient
checkpointing, leaves training as it was."""

from __future__ import annotations

import os

import pytest
import torch
from _reference import lm_loss, make_batch, shard

from dmuon_testing.distributed import run_distributed

pytest.importorskip("transformers")

VOCAB, SEQ, ROWS = 32, 8, 4


def _config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ + 1,
        tie_word_embeddings=tie,
    )


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).logits


def _train(model, optimizer, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three steps on this rank's share of the batches; a probe batch and the model's logits
    for it after them."""
    for step in range(3):
        optimizer.zero_grad()
        tokens = shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size)
        lm_loss(lambda t: _logits(model, t), tokens).backward()
        optimizer.step()
    probe = make_batch(99, 2, SEQ, VOCAB)
    with torch.no_grad():
        return probe, _logits(model, probe)


def _export(rank: int, world_size: int, root: str, tie: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from dmuon_fsdp import (
        Muon,
        NotHeldError,
        dedicate_params,
        dedicated_params_of,
        get_model_state_dict,
    )

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(tie))
    model.generation_config.max_new_tokens = 7  # the model's own, which the export keeps
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, lambda n, p: n.endswith("_proj.weight"))
    dedicated = dedicated_params_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = Muon(model, adamw_lr=3e-3)
    probe, trained_logits = _train(model, optimizer, rank, world_size)

    # save_pretrained on the sharded model reads weights a rank does not hold: refused on
    # every rank, with the recipe below named.
    with pytest.raises(NotHeldError, match=r"save_pretrained reads every weight.*rank0_only"):
        model.save_pretrained(os.path.join(root, f"naive-tie{tie}"))

    # The recipe (README, "Hugging Face export").
    out_dir = os.path.join(root, f"hf-tie{tie}")
    state = get_model_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        with torch.device("meta"):
            export = LlamaForCausalLM(model.config)
        export.load_state_dict(state, assign=True)
        if model.config.tie_word_embeddings:
            export.tie_weights()
        export.generation_config = model.generation_config
        export.save_pretrained(out_dir)
    dist.barrier()
    if rank != 0:
        return state == {}

    reloaded = LlamaForCausalLM.from_pretrained(out_dir)
    loaded = reloaded.state_dict()
    same_keys = sorted(loaded) == sorted(state)
    same_weights = all(torch.equal(loaded[k], v) for k, v in state.items())
    tied = reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert reloaded.generation_config.max_new_tokens == 7
    with torch.no_grad():
        same_logits = torch.equal(_logits(reloaded, probe), trained_logits)
    trained = {dp.fqn for dp in runtime.params}
    return same_keys, same_weights, tied, same_logits, len(trained)


@pytest.mark.distributed
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hugging_face_round_trip(tmp_path, tie):
    results = run_distributed(_export, 2, str(tmp_path), tie)
    same_keys, same_weights, tied, same_logits, dedicated = results[0]
    assert results[1] is True, "rank 1 must get {}"
    assert dedicated == 14, "every q/k/v/o/gate/up/down projection is dedicated"
    assert same_keys and same_weights
    assert tied is tie
    assert same_logits


def _lora(rank: int, world_size: int, root: str):
    """A PEFT LoRA model (bases frozen by ``get_peft_model``), the FAQ's predicate: only the
    adapters are dedicated. PEFT's ``save_pretrained`` and ``merge_and_unload`` on the sharded
    model are refused naming the recipe; ``save_pretrained`` given the gathered weights writes
    an adapter that reloads to the trained logits."""
    import torch.distributed as dist
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from dmuon_fsdp import Muon, NotHeldError, dedicate_params, get_model_state_dict

    def base():
        torch.manual_seed(0)
        return LlamaForCausalLM(_config(False))

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(base(), lora)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = Muon(model)
    probe, trained_logits = _train(model, optimizer, rank, world_size)

    with pytest.raises(NotHeldError, match=r"PEFT's save_pretrained .*state_dict=dmuon\.get_mod"):
        model.save_pretrained(os.path.join(root, "naive"))
    # The first adapter PEFT merges is layer 0's q_proj: its owner holds it (and then fails in
    # torch, adding it to FSDP2's shard of the base), every other rank raises naming the recipe.
    first = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    if not next(dp for dp in runtime.params if dp.fqn == first).is_owner:
        with pytest.raises(NotHeldError, match=r"PEFT's merge .*get_model_state_dict"):
            model.merge_and_unload()

    out_dir = os.path.join(root, "adapter")
    state = get_model_state_dict(model, rank0_only=True)
    model.save_pretrained(out_dir, state_dict=state, is_main_process=rank == 0)
    dist.barrier()
    reloaded = PeftModel.from_pretrained(base(), out_dir)
    with torch.no_grad():
        same_logits = torch.equal(_logits(reloaded, probe), trained_logits)
    kinds = sorted({dp.fqn.split(".")[-3] for dp in runtime.params})
    return kinds, len(runtime.params), same_logits


@pytest.mark.distributed
def test_peft_lora_adapters_train_and_save(tmp_path):
    pytest.importorskip("peft")
    for kinds, dedicated, same_logits in run_distributed(_lora, 2, str(tmp_path)):
        # only the adapters (3 targets x 2 layers x A, B), not the frozen bases
        assert kinds == ["lora_A", "lora_B"] and dedicated == 12
        assert same_logits


def _generate_between_steps(rank: int, world_size: int):
    """The FAQ's evaluation habits on a tiny ``LlamaForCausalLM``: ``generate()`` on every rank
    between two steps, each rank its own prompt and the ranks stopping at different lengths
    (transformers syncs them itself for a model with ``fully_shard`` applied), in a model with
    Hugging Face's ``gradient_checkpointing_enable()``. Returns whether each rank's tokens are
    those of a single-process model with the same weights, whether they stopped at different
    lengths, and whether the weights after the next step equal those of a run without either,
    bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from dmuon_fsdp import Muon, dedicate_params, get_model_state_dict

    mesh = init_device_mesh("cpu", (world_size,))

    def run(habits: bool):
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(False))
        if habits:
            model.gradient_checkpointing_enable()
        dedicate_params(model, mesh, lambda n, p: n.endswith("_proj.weight"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = Muon(model, adamw_lr=3e-3)
        generated = None
        for step in range(3):
            if habits and step == 2:
                generated = _generate_on_every_rank(model, rank)
            optimizer.zero_grad()
            tokens = shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size)
            lm_loss(lambda t: _logits(model, t), tokens).backward()
            optimizer.step()
        return generated, get_model_state_dict(model)

    (tokens, want, stop), with_habits = run(True)
    _, without = run(False)
    return (
        torch.equal(tokens, want),
        stop,
        all(torch.equal(with_habits[k], v) for k, v in without.items()),
    )


def _generate_on_every_rank(model, rank: int):
    """Greedy ``generate()`` of this rank's prompt on the sharded model (in eval mode, as
    around an evaluation), what a single-process model with the gathered weights generates, and
    how many tokens this rank generated. Rank 0 stops at its second new token (its eos), rank 1
    runs to ``max_new_tokens``."""
    from transformers import LlamaForCausalLM

    from dmuon_fsdp import get_model_state_dict

    prompt = make_batch(50 + rank, 1, SEQ, VOCAB)[:, :3]
    plain = LlamaForCausalLM(_config(False))
    plain.load_state_dict(get_model_state_dict(model))
    plain.eval()
    free = plain.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=None)
    new = free[0, 3:].tolist()
    eos = new[1] if rank == 0 else next(t for t in range(VOCAB) if t not in new)
    want = plain.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=eos)
    model.eval()
    tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=eos)
    model.train()
    return tokens, want, tokens.shape[1] - 3


@pytest.mark.distributed
def test_generate_between_steps_with_gradient_checkpointing():
    results = run_distributed(_generate_between_steps, 2)
    assert [r[0] for r in results] == [True, True], "generate() = a plain model's tokens"
    # rank 0 stopped at its eos (the second new token unless the first is the same token)
    assert results[0][1] <= 2 and results[1][1] == 5
    assert [r[2] for r in results] == [True, True], "training after it is bit for bit as without"
