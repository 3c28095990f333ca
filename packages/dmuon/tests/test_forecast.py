"""forecast / dmuon-plan: per-rank figures against independent sums, the K2 planning target,
the measured NS table, the command line and errors."""

import dataclasses
import json
import math
import time
from itertools import product

import pytest
from plan_configs import KIMI_K2, LLAMA_3_70B

from dmuon.plan import Topology, forecast, load_ns_times, model_shapes
from dmuon.plan._cli import main
from dmuon.plan._figures import ADAMW, DMUON, MUON
from dmuon.plan._forecast import takes_gram
from dmuon.plan._model_shapes import tp_dim_of
from dmuon_ownership import WorkItem, elementwise_cost, ns_cost, plan_owners

# A small Llama whose every first dimension divides by 4 (no FSDP2 padding at shard size 4).
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "tie_word_embeddings": False,
}
H, FF, KV, V, L = 64, 128, 32, 256, 3
P_M = L * (2 * H * H + 2 * KV * H + 3 * FF * H)  # q, o; k, v; gate, up, down
K = L * 7  # the dedicated matrices: a reduce carries one presence flag for each
P_F = 2 * V * H + (2 * L + 1) * H  # embedding, head; two norms per layer and the final one
STEPS_F = (2 + 2 * L + 1) * 4  # AdamW's float32 step scalar per FSDP2 tensor

# A tiny Mixtral: 6 experts per stack, 2 layers.
MOE = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 6,
    "vocab_size": 128,
}


def test_the_parameter_split_this_file_assumes() -> None:
    shapes = model_shapes(TINY)
    assert sum(it.numel for it in shapes.dedicated) == P_M
    assert len(shapes.dedicated) == K
    assert sum(it.numel for it in shapes.fsdp) == P_F


@pytest.mark.parametrize("zero", [3, 2])
def test_bytes_per_step_follow_the_architecture_formulas(zero: int) -> None:
    # One dtype everywhere (2 bytes), so the formulas hold as written: per rank on the shard
    # axis dmuon moves (rounds)(G-1)/G P_M with rounds 3 (ZeRO-3) or 2, FSDP2 + AdamW the same,
    # FSDP2 + Muon one more; everything else is FSDP2's, the same in every setup. dmuon's
    # reduce also carries a presence flag per matrix.
    G, R = 4, 2
    topo = Topology(G * R, G, zero=zero, param_dtype="bf16", master_dtype="bf16")
    fc = forecast(TINY, topo)
    rounds = 3 if zero == 3 else 2
    share = (G - 1) / G * 2
    assert fc.traffic[DMUON]["shard"].max == pytest.approx(rounds * share * (P_M + P_F) + share * K)
    assert fc.traffic[ADAMW]["shard"].max == pytest.approx(rounds * share * (P_M + P_F))
    assert fc.traffic[MUON]["shard"].max == pytest.approx(
        share * ((rounds + 1) * P_M + rounds * P_F)
    )
    # Replicate axis: dmuon's reduce + publish sum to P_M over the G columns, FSDP2 all-reduces
    # its shard; at one dtype the means agree and dmuon's max is its fullest column.
    replicate = 2 * (R - 1) / R * 2 * (P_M + P_F) / G
    flags = (R - 1) / R * 2 * K / G
    assert fc.traffic[DMUON]["replicate"].mean == pytest.approx(replicate + flags)
    assert fc.traffic[ADAMW]["replicate"].max == pytest.approx(replicate)
    assert fc.traffic[DMUON]["replicate"].max >= fc.traffic[DMUON]["replicate"].mean
    assert fc.traffic[DMUON]["tp"] == (0.0, 0.0)


def test_payload_per_rank_and_the_bytes_received_from_it() -> None:
    # Payload (CommCounter's unit): every rank of a row carries every dedicated element once
    # per round, in the round's dtype: bf16 broadcasts (ZeRO-3: two), an fp32 reduce, which
    # also carries one presence flag per matrix.
    G, R = 4, 2
    topo = Topology(G * R, G, param_dtype="bf16", master_dtype="fp32", reduce_dtype="fp32")
    fc = forecast(TINY, topo)
    assert len(fc.ranks) == G * R
    column, matrices = [0] * G, [0] * G
    for it in fc.items:
        column[fc.plan.owner_of(it.name).shard] += it.numel
        matrices[fc.plan.owner_of(it.name).shard] += 1
    # FSDP2's rounds over the other parameters: two bf16 all-gathers, an fp32 reduce-scatter,
    # and in HSDP the all-reduce of its fp32 gradient shard.
    rest_shard = (G - 1) / G * P_F * (2 * 2 + 4)
    rest_replicate = 2 * (R - 1) / R * P_F * 4 / G
    for r in range(R):
        for s in range(G):
            rank = fc.rank(replicate=r, shard=s)
            assert (rank.replicate, rank.shard, rank.tp) == (r, s, 0)
            want = {
                "shard/broadcast": 2 * P_M * 2,
                "shard/reduce": (P_M + K) * 4,
                "replicate/reduce": (column[s] + matrices[s]) * 4,
                "replicate/publish": column[s] * 2,
            }
            assert rank.payload == {k: v for k, v in want.items() if v}
    # Received: (n - 1) / n of each payload, plus FSDP2's rounds over the other parameters.
    shard = (G - 1) / G * (P_M * (2 * 2 + 4) + K * 4) + rest_shard
    assert fc.traffic[DMUON]["shard"] == pytest.approx((shard, shard))
    replicate = [
        (R - 1) / R * (c * (4 + 2) + k * 4) + rest_replicate
        for c, k in zip(column, matrices, strict=True)
    ]
    assert fc.traffic[DMUON]["replicate"].max == pytest.approx(max(replicate))
    assert fc.traffic[DMUON]["replicate"].mean == pytest.approx(sum(replicate) / G)
    # ZeRO-2 broadcasts once; one shard group of the 8 ranks has no replicate axis.
    z2 = forecast(TINY, Topology(8, zero=2, param_dtype="bf16", reduce_dtype="fp32"))
    assert {rank.payload["shard/broadcast"] for rank in z2.ranks} == {P_M * 2}
    assert all(not any(k.startswith("replicate/") for k in r.payload) for r in z2.ranks)
    # A world of one rank issues no collective.
    assert forecast(TINY, Topology(1)).rank().payload == {}
    with pytest.raises(ValueError, match=r"Forecast.rank: shard must be an int in \[0, 4\)"):
        fc.rank(shard=4)


def test_tensor_parallel_payload() -> None:
    # Gather mode: every rank of an owner coordinate's TP group carries the whole matrix's NS
    # input (fp32 momentum) to the TP owner and the update back, once each.
    T = 8
    fc = forecast(LLAMA_3_70B, Topology(512, shard_size=8, tp=T, tp_ns="gather"))
    whole: dict[tuple[int, int], int] = {}
    for it in fc.items:
        if it.tp == T:
            owner = fc.plan.owner_of(it.name)
            key = (owner.replicate, owner.shard)
            whole[key] = whole.get(key, 0) + it.numel * 4
    for rank in fc.ranks:
        carried = whole.get((rank.replicate, rank.shard), 0)
        assert rank.payload.get("tp/gather", 0) == rank.payload.get("tp/scatter", 0) == carried
        assert "tp/all_reduce" not in rank.payload
    # "auto", Muon's default, gathers them all: distributed Gram NS of an 8192 x 28672 MLP
    # matrix would all-reduce the fp32 8192 x 8192 Gram matrix twice (4.6 x the bytes a rank
    # carries for its share of the gather) and repeat the Gram iterations on every rank.
    auto = forecast(LLAMA_3_70B, Topology(512, shard_size=8, tp=T))
    assert [r.payload for r in auto.ranks] == [r.payload for r in fc.ranks]
    assert auto.ns_ms[DMUON].max == fc.ns_ms[DMUON].max
    # "gram" takes every matrix whose shards split its long side, the square ones too:
    # not k_proj and v_proj (1024 x 8192, split into 1024 / 8 rows).
    gram = forecast(LLAMA_3_70B, Topology(512, shard_size=8, tp=T, tp_ns="gram"))
    kv = sum(
        it.numel * 4 for it in gram.items if it.name.endswith(("k_proj.weight", "v_proj.weight"))
    )
    assert sum(r.payload.get("tp/gather", 0) for r in gram.ranks) == T * kv


def test_state_follows_fsdp2_padding_and_torch_chunk() -> None:
    # 61 rows over 4 shard indices: torch.chunk gives 16, 16, 16, 13; FSDP2 allocates every
    # shard padded to 16 rows (its masters), the optimizer states follow the unpadded shard.
    config = {**TINY, "vocab_size": 61}
    G = 4
    fc = forecast(config, Topology(G, param_dtype="fp32"))
    rows = [len(range(61)[s * 16 : (s + 1) * 16]) for s in range(G)]
    assert rows == [16, 16, 16, 13]
    norms = (2 * L + 1) * H // G  # every norm splits evenly
    owned = [0] * G
    for it in fc.items:
        owned[fc.plan.owner_of(it.name).shard] += it.numel * 4
    for s in range(G):
        state = fc.rank(shard=s).state
        assert state["masters"] == (2 * 16 * H + norms) * 4 + owned[s]
        fsdp_states = (2 * rows[s] * H + norms) * 2 * 4 + (2 * L + 3) * 4  # moments, steps
        assert state["optimizer states"] == fsdp_states + owned[s]
        assert state["HSDP replica copies"] == 0
    assert fc.memory[DMUON]["optimizer states"].max == max(
        fc.rank(shard=s).state["optimizer states"] for s in range(G)
    )


def test_memory_adds_up_over_the_ranks() -> None:
    G, R = 4, 2
    topo = Topology(G * R, G)  # bf16 compute, fp32 masters and states
    fc = forecast(TINY, topo)
    slots = G * R
    mem = fc.memory[DMUON]
    # Each dedicated matrix has one owner in the whole grid; FSDP2 shards over G.
    assert mem["masters"].mean == pytest.approx(P_M * 4 / slots + P_F * 4 / G)
    assert mem["optimizer states"].mean == pytest.approx(P_M * 4 / slots + P_F * 8 / G + STEPS_F)
    # A replica keeps the compute copy of what its shard column owns on the other replicas.
    assert mem["HSDP replica copies"].mean == pytest.approx((R - 1) * P_M * 2 / slots)
    assert fc.memory[ADAMW]["masters"].max == pytest.approx((P_M + P_F) * 4 / G)
    steps = STEPS_F + 7 * L * 4  # with every dedicated matrix on AdamW too
    assert fc.memory[ADAMW]["optimizer states"].max == pytest.approx((P_M + P_F) * 8 / G + steps)
    assert fc.memory[MUON]["optimizer states"].max == pytest.approx(
        (P_M + 2 * P_F) * 4 / G + STEPS_F
    )
    # The most loaded owner holds what the plan gave it.
    owned = {slot: 0 for slot in range(slots)}
    for it in fc.items:
        owned[fc.plan.slot_of(fc.plan.owner_of(it.name))] += it.numel * 4
    assert mem["masters"].max == pytest.approx(max(owned.values()) + P_F * 4 / G)


def test_unsharded_layer_buffers() -> None:
    fc = forecast(TINY, Topology(4, zero=3))
    layer = 2 * H * H + 2 * KV * H + 3 * FF * H
    # ZeRO-3: one layer at a time; a rank receives the layer's matrices that its shard index
    # does not own (compute dtype, 2 bytes).
    received = [
        max(
            sum(
                it.numel * 2
                for it in fc.items
                if it.boundary == f"model.layers.{b}" and fc.plan.owner_of(it.name).shard != s
            )
            for b in range(L)
        )
        for s in range(4)
    ]
    peers = fc.unsharded[DMUON]["dmuon peer buffers"]
    assert peers.max == max(received) and peers.mean == pytest.approx(sum(received) / 4)
    root = (2 * V * H + H) * 2  # embedding, head, final norm: FSDP2 holds them all forward
    norms = 2 * H * 2
    assert fc.unsharded[DMUON]["all"].max == max(received) + norms + root
    assert fc.unsharded[ADAMW]["all"].max == (layer * 2 + norms) + root
    z2 = forecast(TINY, Topology(4, zero=2))
    assert z2.unsharded[ADAMW]["all"].max == L * (layer * 2 + norms) + root


def test_experts_follow_torch_chunk_and_load_the_plan() -> None:
    G = 4
    fc = forecast(MOE, Topology(G))
    items = list(range(6))
    chunk = math.ceil(6 / G)
    held = [len(items[s * chunk : (s + 1) * chunk]) for s in range(G)]  # torch.chunk's split
    assert held == [2, 2, 2, 0]
    shapes = model_shapes(MOE)
    for slot in range(G):
        # A fused gate_up stack (E, 2I, H) is two (I, H) matrices per expert, as the runtime
        # orthogonalises gate and up apart; down (E, H, I) is one.
        want = 0.0
        for it in shapes.experts:
            rows, cols = it.shape[1:]
            if "gate_up" in it.name:
                want += ns_cost((2 * held[slot], rows // 2, cols)) if held[slot] else 0.0
            else:
                want += ns_cost((held[slot], rows, cols)) if held[slot] else 0.0
        assert fc.plan.base_loads[slot] == pytest.approx(want)
    assert any("1 of 4 shard indices hold none" in note for note in fc.notes)
    # The plan is plan_owners' with those base loads: what the runtime will call.
    again = plan_owners(shapes.dedicated, G, 1, base_loads=fc.plan.base_loads)
    assert again.fingerprint() == fc.plan.fingerprint()
    # A dense model plans exactly as dedicate_params does (no base loads at all).
    dense = forecast(TINY, Topology(4))
    assert dense.plan == plan_owners(model_shapes(TINY).dedicated, 4)


def test_kimi_k2_on_1024_ranks_plans_fast_and_balanced() -> None:
    topo = Topology(1024, shard_size=128)  # 8 replicas x 128 shards: 3 experts per stack each
    timings: list[float] = []
    while not timings or (min(timings) >= 2.0 and len(timings) < 3):
        start = time.process_time()
        fc = forecast(KIMI_K2, topo)
        timings.append(time.process_time() - start)
    print(
        f"\nKimi K2 on 1024 ranks (8 x 128): forecast in {min(timings):.3f} s of CPU, "
        f"NS load max/mean {fc.balance:.4f} (experts included)"
    )
    assert min(timings) < 2.0, f"forecast took {min(timings):.3f} s of CPU"
    # The experts' work is equal on every rank (3 per stack). On top of it LPT spreads the
    # dense matrices, which it cannot split: the layer-0 MLP's 18432x7168 matrices are about
    # 6 % of a rank's experts, so whole-matrix ownership alone stops at max/mean 1.061. Expert
    # sources move expert shards off the replicas that own such a matrix.
    assert fc.balance <= 1.05, fc.plan.summary()
    assert fc.plan.expert_sources
    without = plan_owners(fc.items, 128, 8, base_loads=fc.plan.base_loads)
    assert not without.expert_sources and without.imbalance + 1 > 1.06
    assert max(fc.plan.loads) < max(without.loads)
    # Each sourced stack shard is broadcast over its shard column in fp32 (the master dtype),
    # on top of the bf16 publish of the dense matrices the column owns: the forecast's
    # replicate publish payload, on every replica of that shard.
    stacks = {item.name: item for item in fc.shapes.experts}
    for shard in {s.shard for s in fc.plan.expert_sources[:5]} | {127}:
        sourced = sum(
            3 * math.prod(stacks[s.stack].shape[1:]) * 4  # 3 experts per stack per shard
            for s in fc.plan.expert_sources
            if s.shard == shard
        )
        column = sum(
            item.numel * 2
            for item in fc.shapes.dedicated
            if fc.plan.owner_of(item.name).shard == shard
        )
        for replicate in (0, 7):
            payload = fc.rank(replicate=replicate, shard=shard).payload
            assert payload.get("replicate/publish", 0) == column + sourced, shard
    assert fc.plan.base_loads and min(fc.plan.base_loads) > 0
    expert_share = min(fc.plan.base_loads) / max(fc.plan.loads)
    assert expert_share > 0.9  # the experts are most of every rank's work
    # On one 1024-rank shard group 640 ranks hold no expert: the forecast says so.
    flat = forecast(KIMI_K2, Topology(1024))
    assert flat.balance > 2
    assert any("640 of 1024 shard indices hold none" in note for note in flat.notes)


def test_ns_times_table_and_its_model() -> None:
    table = load_ns_times()
    assert table.card.startswith("NVIDIA H200") and table.date == "2026-11-29"
    for batch, rows, cols, ms in table.measured:
        assert table.predict_ms(batch, rows, cols) == pytest.approx(ms)
    # A call the table does not hold: Llama-3-8B's layer (q, o; k, v; gate, up; down batched by
    # shape) measured 17.641 ms in the same run. The FLOP-model interpolation is within 10 %.
    layer = (
        table.predict_ms(2, 4096, 4096)
        + table.predict_ms(2, 1024, 4096)
        + table.predict_ms(2, 14336, 4096)
        + table.predict_ms(1, 4096, 14336)
    )
    assert abs(layer - 17.641) / 17.641 < 0.10, layer
    # Outside the measured range the nearest rate holds: time scales with FLOPs.
    small, big = table.predict_ms(1, 512, 2048), table.predict_ms(1, 1024, 4096)
    assert small / big == pytest.approx(table.flops(1, 512, 2048) / table.flops(1, 1024, 4096))


def test_predicted_ns_time_batches_like_muon() -> None:
    table = load_ns_times()
    topo = Topology(1)
    every = forecast(TINY, topo, ns_batch_bytes=None)
    one_by_one = forecast(TINY, topo, ns_batch_bytes=1)
    shapes = [(H, H), (KV, H), (FF, H), (H, FF)]
    counts = {(H, H): 2 * L, (KV, H): 2 * L, (FF, H): 2 * L, (H, FF): L}
    assert every.ns_ms[DMUON].max == pytest.approx(
        sum(table.predict_ms(counts[s], *s) for s in shapes)
    )
    assert one_by_one.ns_ms[DMUON].max == pytest.approx(
        sum(counts[s] * table.predict_ms(1, *s) for s in shapes)
    )
    assert every.ns_ms[MUON].max == every.ns_ms[DMUON].max  # one rank does everything
    # Many ranks: plain Muon still orthogonalises every matrix on every rank.
    wide = forecast(TINY, Topology(8))
    assert wide.ns_ms[MUON].max == pytest.approx(forecast(TINY, topo).ns_ms[MUON].max)
    assert wide.ns_ms[DMUON].max < wide.ns_ms[MUON].max


def test_a_declared_split_is_planned_and_timed_as_its_pieces() -> None:
    # TINY with each layer's q, k and v fused into one weight that declares its split, as
    # dedicate_params hands it to the planner: the owner runs NS on q (H, H) and k, v (KV, H).
    shapes = model_shapes(TINY)
    fused: list[WorkItem] = []
    for item in shapes.dedicated:
        layer, _, leaf = item.name.partition(".self_attn.")
        if leaf in ("k_proj.weight", "v_proj.weight"):
            continue
        if leaf == "q_proj.weight":
            pieces = ((1, H, H), (2, KV, H))
            item = WorkItem(f"{layer}.self_attn.qkv_proj.weight", (H + 2 * KV, H), item.boundary)
            fused.append(dataclasses.replace(item, matrices=pieces))
        else:
            fused.append(item)
    split = dataclasses.replace(shapes, dedicated=tuple(fused))
    joint = dataclasses.replace(
        split, dedicated=tuple(dataclasses.replace(it, matrices=()) for it in fused)
    )
    topo = Topology(1)
    figures = {
        name: forecast(model, topo, ns_batch_bytes=None)
        for name, model in (("separate", TINY), ("split", split), ("joint", joint))
    }
    assert figures["split"].plan == plan_owners(split.dedicated, 1)
    # Planned and timed as the separate q, k, v: the same work and the same NS calls.
    loads = {name: fc.plan.loads for name, fc in figures.items()}
    assert loads["split"] == loads["separate"] and loads["joint"][0] > loads["split"][0]
    ns_ms = {name: fc.ns_ms[DMUON].max for name, fc in figures.items()}
    assert ns_ms["split"] == pytest.approx(ns_ms["separate"])
    assert ns_ms["joint"] != pytest.approx(ns_ms["separate"])
    assert figures["split"].work[MUON].max == figures["separate"].work[MUON].max
    # Bytes do not depend on how a weight is orthogonalised.
    bytes_of = [forecast(m, Topology(4)).rank().payload for m in (split, joint)]
    assert bytes_of[0] == bytes_of[1]


@pytest.mark.parametrize("tp_ns", ["auto", "gather", "gram"])
def test_tp_ns_is_chosen_as_the_optimizer_chooses(tp_ns: str) -> None:
    from dmuon_fsdp.holder import TPMode, choose_tp_mode
    from dmuon_ns import NewtonSchulz

    gram_ns = NewtonSchulz(backend="gram")  # Muon's default NS
    wide = TINY | {"intermediate_size": 2048}  # 64 x 2048: auto takes gram at TP 8 in fp32
    taken = set()
    for config, tp, itemsize in product((LLAMA_3_70B, KIMI_K2, TINY, wide), (2, 8), (2, 4)):
        for item in model_shapes(config, tp=tp).dedicated:
            if item.tp == 1:
                continue
            split = tp_dim_of(item.name)
            mode = choose_tp_mode(TPMode(tp_ns), item.shape, split, gram_ns, tp, itemsize)
            gram = takes_gram(tp_ns, item, itemsize=itemsize)
            assert gram == (mode is TPMode.GRAM), (tp_ns, item.name, tp, itemsize)
            taken.add(gram)
    assert taken == ({False} if tp_ns == "gather" else {True, False})
    with pytest.raises(ValueError, match=r"Topology: tp_ns must be one of \['auto', 'gather'"):
        Topology(8, tp=2, tp_ns="ring")
    assert "TP 2 (NS: gram)" in Topology(8, tp=2, tp_ns="gram").describe()


def test_tensor_parallel_figures() -> None:
    fc = forecast(LLAMA_3_70B, Topology(512, shard_size=8, tp=8, tp_ns="gather"))
    assert fc.plan.tp_size == 8 and fc.plan.world_size == 64
    tp_numel = sum(it.numel for it in fc.items if it.tp == 8)
    # Plain Muon: every rank all-gathers every TP-sharded gradient (bf16).
    assert fc.traffic[MUON]["tp"].max == pytest.approx(7 / 8 * tp_numel * 2)
    # dmuon's gather mode: per matrix the TP owner receives 7/8 of the momentum (fp32) and
    # each of the 7 others 1/8 of the update: 2 x 7/8 of the matrix per TP group, over 512.
    assert fc.traffic[DMUON]["tp"].mean == pytest.approx(2 * 7 / 8 * tp_numel * 4 / 512)
    assert fc.balance < 1.01


@pytest.mark.parametrize("tp_ns", ["gather", "gram"])
def test_every_tp_rank_steps_its_own_shard(tp_ns: str) -> None:
    # The momentum and update passes run on each rank's TP shard whichever way NS runs (NS
    # gathers inside), so the step time less NS is one figure on every rank; under "gather"
    # the TP owners were charged the whole matrices' passes (0.23072 against 0.22355 us above
    # NS on the slower rank). One slot, one layer, each matrix its own unit.
    config = TINY | {"num_hidden_layers": 1, "intermediate_size": 96}
    fc = forecast(config, Topology(2, tp=2, tp_ns=tp_ns), small_param_threshold=0)
    step, ns = fc.step_ms[DMUON], fc.ns_ms[DMUON]
    assert step.max - ns.max == pytest.approx(step.mean - ns.mean, rel=1e-12)


def test_tp_work_is_split_as_the_runtime_splits_it() -> None:
    # Under distributed Gram NS every rank of the TP group runs Gram NS on its block (the
    # Gram matrix on the unsplit side) and the momentum and update on its shard; the plan's
    # tp_loads, made before tp_ns is known, charge the whole matrix to its TP owner (the
    # work figure was the same under "gather" and "gram").
    config = TINY | {"num_hidden_layers": 1, "intermediate_size": 96}
    fc = forecast(config, Topology(2, tp=2, tp_ns="gram"), small_param_threshold=0)
    expected = 0.0
    for item in fc.items:
        if takes_gram("gram", item, itemsize=4):
            short, long = sorted(item.shape)
            block = 4 * short**2 * (long // 2) * 2 + 8 * short**3 * 5
            expected += 2 * (elementwise_cost(item.numel // 2, item.route) + block)
        else:
            expected += ns_cost(item.shape, item.route)
    assert {takes_gram("gram", item, itemsize=4) for item in fc.items} == {True, False}
    assert fc.work[DMUON].mean * 2 == pytest.approx(expected, rel=1e-12)


def test_gram_ns_time_is_each_blocks_gram_ns() -> None:
    # Every matrix by distributed Gram NS (square q, k, v, o split on either side; the MLP on
    # its long side), one call per matrix on every rank of the group, the Gram matrix on the
    # unsplit side: 64 x 64 for the 64 x 32 blocks of q, k, v, o, where ns_flops(64, 32)
    # would iterate on 32 x 32 (the prediction was 0.23 us, not 0.41).
    config = TINY | {"num_hidden_layers": 1, "intermediate_size": 256, "num_key_value_heads": 4}
    fc = forecast(config, Topology(2, tp=2, tp_ns="gram"), small_param_threshold=0)
    assert all(takes_gram("gram", item, itemsize=4) for item in fc.items)
    table = load_ns_times()
    expected = 0.0
    for item in fc.items:
        short, long = sorted(item.shape)
        flops = 4 * short**2 * (long // 2) * (1 + table.restarts) + 8 * short**3 * table.steps
        expected += table.ms_of_flops(flops)
    assert fc.ns_ms[DMUON].max == pytest.approx(expected, rel=1e-12)
    assert fc.ns_ms[DMUON].mean == pytest.approx(expected, rel=1e-12)


def test_gathered_tp_matrices_are_timed_one_per_call() -> None:
    # Gather mode: the TP owner orthogonalises each whole matrix in a call of its own (each TP
    # matrix has its own NS function, so Muon batches none); batched by shape, the prediction
    # took the larger calls' higher rate.
    # (Sizes the measured curve holds: below its smallest call the rate is one figure.)
    config = TINY | {"num_hidden_layers": 2, "hidden_size": 2048, "intermediate_size": 4096}
    fc = forecast(config, Topology(2, tp=2, tp_ns="gather"))
    table, per_rank = load_ns_times(), [0.0, 0.0]
    for item in fc.items:
        per_rank[fc.plan.tp_owner_of(item.name)] += table.predict_ms(1, *item.shape)
    assert fc.ns_ms[DMUON].max == pytest.approx(max(per_rank), rel=1e-12)
    assert fc.ns_ms[DMUON].mean == pytest.approx(sum(per_rank) / 2, rel=1e-12)


def test_command_line(tmp_path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_70B))
    assert main([str(path), "--ranks", "512", "--replicas", "8"]) == 0
    out = capsys.readouterr().out
    assert "dmuon-plan: llama, 80 layers, 70.55 B parameters" in out
    assert "512 ranks = 8 replicas x 64 shards (HSDP)" in out
    assert "NS time (ms, PREDICTED)" in out and "PREDICTED: NS times" in out
    step = next(line for line in out.splitlines() if "step time (ms, PREDICTED)" in line)
    fc = forecast(LLAMA_3_70B, Topology(512, shard_size=64))
    assert step.split()[-4:] == [
        f"{v:,.2f}"
        for v in (
            fc.step_ms[DMUON].max,
            fc.step_ms[DMUON].mean,
            fc.step_ms[ADAMW].max,
            fc.step_ms[MUON].max,
        )
    ]
    assert "bytes per step (GiB received per rank)" in out
    assert "GiB payload per rank, as CommCounter counts" in out
    assert main([str(tmp_path), "--ranks", "512", "--shard-size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["topology"]["replicas"] == 8
    assert data["plan"]["matrices"] == 560
    assert set(data["predicted_ns_ms"]) == set(data["predicted_step_ms"]) == {DMUON, ADAMW, MUON}
    payload = data["dmuon_payload_bytes_per_step"]
    assert payload["shard/broadcast"]["max"] == fc.rank().payload["shard/broadcast"]
    assert payload["replicate"]["mean"] == pytest.approx(
        sum(
            sum(v for k, v in rank.payload.items() if k.startswith("replicate/"))
            for rank in fc.ranks
        )
        / 512
    )
    assert data["ns_times"]["card"].startswith("NVIDIA H200")
    # --tp-ns: how the TP matrices are orthogonalised, "auto" (Muon's default) unless given.
    # 70B at TP 8: "auto" gathers every matrix (as the optimizer would).
    for tp_ns, gram in (("gather", False), ("gram", True), ("auto", False), (None, False)):
        flag = [] if tp_ns is None else ["--tp-ns", tp_ns]
        assert (
            main([str(path), "--ranks", "512", "--replicas", "8", "--tp", "8", *flag, "--json"])
            == 0
        )
        data = json.loads(capsys.readouterr().out)
        assert ("tp/all_reduce" in data["dmuon_payload_bytes_per_step"]) == gram, tp_ns
    for argv, message in (
        (["--ranks", "10", "--shard-size", "4"], "shard_size=4 does not divide the 10"),
        (["--ranks", "8", "--replicas", "3"], "--replicas 3 does not divide --ranks 8"),
        (["--ranks", "8", "--param-dtype", "int8"], "unsupported dtype 'int8'"),
    ):
        with pytest.raises(SystemExit) as raised:
            main([str(path), *argv])
        assert raised.value.code == 2
        assert message in capsys.readouterr().err


def test_topology_and_forecast_errors() -> None:
    with pytest.raises(ValueError, match=r"ranks=10 is not a multiple of tp=4"):
        Topology(10, tp=4)
    with pytest.raises(ValueError, match=r"ranks must be an int >= 1, got 0"):
        Topology(0)
    with pytest.raises(ValueError, match=r"zero must be 2 .* or 3 .*, got 1"):
        Topology(8, zero=1)
    with pytest.raises(ValueError, match=r"param_dtype needs a dtype, got None"):
        Topology(8, param_dtype=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"topology must be a Topology, got int"):
        forecast(TINY, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"made for tp=\[2\] but the topology has tp=1"):
        forecast(model_shapes(TINY, tp=2), Topology(4))
    with pytest.raises(ValueError, match=r"ns_batch_bytes must be an int >= 1"):
        forecast(TINY, Topology(4), ns_batch_bytes=0)
    defaults = Topology(16, 4, tp=2)
    assert (defaults.replicas, defaults.optim_dtype, defaults.reduce_dtype) == (
        2,
        "float32",
        "bfloat16",
    )


# dmuon's optimizer step on the two Llama stacks of benchmarks/step_bench.py (bf16 weights and
# states, world size 1, no embedding or head), measured on an NVIDIA H200 (driver 580.159.04,
# 700 W, torch 2.11.0+cu130, triton 3.6.0, no quack installed) on 2026-12-03, 09:26-09:30 UTC:
# `step_bench.py --config C --variants dmuon --warmup 3 --iters 10`, four runs per config
# (BENCHMARKS.md, "The step in phases"). Those runs had no quack, so the prediction uses the
# table of what NS runs without it, and they batched NS at the then-default 64 MiB cap.
STEP_BENCH_NS_BATCH_BYTES = 64 * 2**20
STEP_BENCH_MS = {
    (2048, 8192, 16): (59.41, 59.62, 59.61, 60.91),
    (4096, 14336, 8): (171.93, 171.94, 172.40, 172.15),
}


@pytest.mark.parametrize(("hidden", "intermediate", "layers"), sorted(STEP_BENCH_MS))
def test_predicted_step_time_matches_the_h200_step_bench(
    hidden: int, intermediate: int, layers: int
) -> None:
    # The nearest config the planner takes to step_bench's LlamaStack: a one-token vocabulary
    # with tied embeddings stands in for "no embedding or head" (hidden AdamW elements).
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 1,
        "tie_word_embeddings": True,
    }
    topology = Topology(1, param_dtype="bf16", master_dtype="bf16")
    fc = forecast(
        config,
        topology,
        ns_times=load_ns_times("ns_times_h200_no_quack.json"),
        ns_batch_bytes=STEP_BENCH_NS_BATCH_BYTES,
    )
    predicted = fc.step_ms[DMUON].max
    measured = STEP_BENCH_MS[(hidden, intermediate, layers)]
    print(
        f"H={hidden} I={intermediate} L={layers}: predicted step {predicted:.1f} ms (NS "
        f"{fc.ns_ms[DMUON].max:.1f} ms), measured {min(measured)}-{max(measured)} ms"
    )
    for ms in measured:
        assert abs(predicted - ms) <= 0.2 * ms
