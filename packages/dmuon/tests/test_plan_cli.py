"""dmuon-plan: on bad input one error line that names the file or the option and what is
wrong, exit 2; with --gpu-memory, whether each setup fits and its step time per GPU."""

from __future__ import annotations

import json
import re

import pytest

from dmuon.plan import Topology, forecast, load_ns_times, model_shapes
from dmuon.plan._cli import main
from dmuon.plan._figures import ADAMW, DMUON, MUON
from dmuon.plan._gpus import GPUS

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run dmuon-plan, expect exit status 2 and nothing on stdout; its one stderr line."""
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dmuon-plan: error: ")
    return lines[0]


def test_a_config_that_is_not_a_json_object_is_one_error_naming_the_file(tmp_path, capsys) -> None:
    good = json.dumps(LLAMA, indent=2)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(good[: good.index('"vocab_size"') + 5])  # a download cut short
    line = _error([str(truncated), "--ranks", "8"], capsys)
    assert f"'{truncated}' is not valid JSON: line 8, column 3:" in line
    assert "Unterminated string" in line and "the file ends there" in line
    malformed = tmp_path / "malformed.json"
    malformed.write_text(good.replace('"num_hidden_layers": 2,', '"num_hidden_layers": 2,,'))
    line = _error([str(malformed), "--ranks", "8"], capsys)
    assert f"'{malformed}' is not valid JSON: line 5, column 26:" in line
    assert "Expecting property name" in line and "ends there" not in line
    for text, kind in (("[1, 2]", "an array"), ("null", "null"), ('"llama"', "a string")):
        (tmp_path / "not_an_object.json").write_text(text)
        line = _error([str(tmp_path / "not_an_object.json"), "--ranks", "8"], capsys)
        assert f"not_an_object.json' holds {kind}, not a JSON object" in line
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"model_type": "\xff"}')
    line = _error([str(binary), "--ranks", "8"], capsys)
    assert f"'{binary}' is not UTF-8 text (byte 16" in line


def test_a_path_without_a_config_is_one_error_naming_it(tmp_path, capsys) -> None:
    missing = tmp_path / "missing" / "config.json"
    line = _error([str(missing), "--ranks", "8"], capsys)
    assert f"'{missing}' does not exist; pass a config.json or a model directory" in line
    line = _error([str(tmp_path), "--ranks", "8"], capsys)
    assert f"'{tmp_path}' is a directory without a config.json" in line
    # The same messages from Python, as ValueError.
    with pytest.raises(ValueError, match=r"does not exist; pass a config.json"):
        model_shapes(missing)


# Meta-Llama-3-8B's config.json, as its model repository gives it.
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
GIB = 2**30
# Its parameters: per layer q, k, v, o, gate, up, down and two norms; the embedding, the head
# and the final norm at the root.
LAYER = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096
ROOT = 2 * 128256 * 4096 + 4096
TENSORS = 32 * 9 + 3


def _config(tmp_path, **changes: object) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_3_8B, **changes}, indent=2))
    return str(path)


def _verdicts(out: str) -> dict[str, str]:
    """'dmuon, max rank' -> 'fits' / 'does not fit', from the report's fit lines."""
    found = re.findall(r"^  (.+ rank) +(does not fit|fits) ", out, re.M)
    return dict(found)


def test_llama_3_8b_on_8_gpus_of_80_gib_fits_and_has_a_step_time(tmp_path, capsys) -> None:
    config = _config(tmp_path)
    assert main([config, "--ranks", "8", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "dmuon-plan: llama, 32 layers, 8.03 B parameters" in out
    assert _verdicts(out) == {
        "dmuon, max rank": "fits",
        "dmuon, mean rank": "fits",
        "FSDP2 + AdamW, max rank": "fits",
        "FSDP2 + Muon, max rank": "fits",
    }
    # FSDP2 + AdamW by hand: every first dimension divides by 8, so a rank holds 1/8 of each
    # tensor: fp32 masters, two fp32 moments (and a float32 step per tensor), fp32 sharded
    # gradients; ZeRO-3 unshards two bf16 layers (prefetch) and the root, and backward holds
    # one layer's and the root's bf16 gradients.
    params = 32 * LAYER + ROOT
    assert params == 8_030_261_248  # the published count
    adamw = params / 8 * (4 + 8 + 4) + TENSORS * 4 + (2 * LAYER + ROOT) * 2 + (LAYER + ROOT) * 2
    line = next(x for x in out.splitlines() if x.startswith("  FSDP2 + AdamW, max rank"))
    assert f"fits          {adamw / GIB:,.2f} GiB, {80 - adamw / GIB:,.2f} GiB left" in line
    assert line.endswith(
        f"largest term: optimizer states ({(params + TENSORS * 4) / GIB:,.2f} GiB)"
    )
    # Its step time: the fused AdamW pass (28 bytes per element at the H200's 4,000 GB/s), and
    # on the shard axis 7/8 of two bf16 all-gathers and a bf16 reduce-scatter at NVLink's
    # 450 GB/s (8 ranks: one node).
    optimizer_ms = params / 8 * 28 / 4000e6
    shard_ms = 7 / 8 * params * 6 / 450e6
    rows = {x.split("  ")[1].strip(): x for x in out.splitlines() if x.startswith("  ")}
    assert rows["optimizer step"].split()[-2] == f"{optimizer_ms:,.2f}"
    assert rows["shard axis, 450 GB/s"].split()[-2] == f"{shard_ms:,.2f}"
    assert rows["total"].split()[-2] == f"{optimizer_ms + shard_ms:,.2f}"
    assert "links: shard axis: NVLink" in out and "NS times measured on NVIDIA H200" in out
    # dmuon's rows are the forecast's own figures over the same links: its bytes received on
    # the shard axis (the payload-derived row) and its optimizer step.
    fc = forecast(config, Topology(8), gpu=80)
    assert fc.fit is not None
    step = fc.fit.step_ms[DMUON]
    assert step["shard axis"].max == pytest.approx(fc.traffic[DMUON]["shard"].max / 450e6)
    assert step["optimizer step"] == fc.step_ms[DMUON]
    assert rows["total"].split()[1] == f"{step['total'].max:,.2f}"
    memory = fc.fit.memory[DMUON]
    assert memory["masters"] == fc.memory[DMUON]["masters"]
    assert memory["optimizer states"] == fc.memory[DMUON]["optimizer states"]


def test_llama_3_8b_on_8_gib_does_not_fit(tmp_path, capsys) -> None:
    assert main([_config(tmp_path), "--ranks", "8", "--gpu-memory", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fits = data["fit"]["fits"]
    assert fits == {s: {"max_rank": False, "mean_rank": False} for s in (DMUON, ADAMW, MUON)}
    assert data["fit"]["largest_term"][DMUON]["max_rank"] == "optimizer states"
    assert main([_config(tmp_path), "--ranks", "8", "--gpu-memory", "8"]) == 0
    assert set(_verdicts(capsys.readouterr().out).values()) == {"does not fit"}
    # From Python: the verdict is false unless the rank that needs the most fits.
    fits = forecast(_config(tmp_path), Topology(8), gpu=8).fit.fits(DMUON)  # type: ignore[union-attr]
    assert fits == (False, False) and not fits and not fits.max_rank
    roomy = forecast(_config(tmp_path), Topology(8), gpu=141).fit.fits(DMUON)  # type: ignore[union-attr]
    assert roomy and roomy.max_rank and roomy.mean_rank
    with pytest.raises(ValueError, match=r"setup must be one of \['dmuon', "):
        forecast(_config(tmp_path), Topology(8), gpu=141).fit.fits("dmon")  # type: ignore[union-attr]


def test_another_card_scales_the_h200_ns_times_and_says_so(tmp_path, capsys) -> None:
    config = _config(tmp_path)
    assert main([config, "--ranks", "16", "--gpu-memory", "a100-80g", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    table = data["ns_times"]
    assert not table["measured_on_this_card"]
    assert (
        table["scaled_from"].startswith("NVIDIA H200") and table["card"] == "NVIDIA A100 SXM 80GB"
    )
    assert table["time_scale"] == pytest.approx(989.4 / 312.0)
    h200 = forecast(config, Topology(16), gpu="h200")
    predicted = data["predicted_ns_ms"][DMUON]["max"]
    assert predicted == pytest.approx(h200.ns_ms[DMUON].max * 989.4 / 312.0)
    # 16 ranks in one shard group span two 8-GPU nodes: the shard axis runs on InfiniBand HDR.
    assert data["fit"]["links"]["shard"] == {
        "gb_s": 25.0,
        "via": "InfiniBand HDR, 200 Gb/s per GPU (across NVLink domains)",
        "used": True,
    }
    assert not data["fit"]["links"]["replicate"]["used"]  # one shard group: no replicas
    assert main([config, "--ranks", "16", "--gpu-memory", "a100-80g"]) == 0
    out = capsys.readouterr().out
    assert "NS times SCALED FROM NVIDIA H200 x3.17" in out and "not measured on this card" in out
    assert "PREDICTED, SCALED FROM NVIDIA H200" in out
    assert "measured on NVIDIA A100" not in out


def test_links_follow_the_mesh_and_the_flags(tmp_path, capsys) -> None:
    config = _config(tmp_path)
    # HSDP 2 x 8: a shard group is one node (NVLink), the replicas are two nodes (NDR).
    argv = [config, "--ranks", "16", "--replicas", "2", "--gpu-memory", "h100-80g"]
    assert main([*argv, "--json"]) == 0
    links = json.loads(capsys.readouterr().out)["fit"]["links"]
    assert links["shard"]["gb_s"] == 450 and links["shard"]["via"].startswith("NVLink")
    assert links["replicate"]["gb_s"] == 50 and links["replicate"]["via"].startswith(
        "InfiniBand NDR, 400 Gb/s per GPU"
    )
    assert not links["tp"]["used"]
    assert main([*argv, "--replicate-gb-s", "25", "--nvlink-gpus", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    links = data["fit"]["links"]
    assert links["replicate"] == {"gb_s": 25.0, "via": "as given", "used": True}
    assert links["shard"]["via"].startswith("InfiniBand")  # 8 ranks over 4-GPU domains
    replicate_ms = data["fit"]["predicted_step_time_ms"][ADAMW]["replicate axis"]["max"]
    assert replicate_ms == pytest.approx(data["bytes_per_step"][ADAMW]["replicate"]["max"] / 25e6)
    assert main([*argv, "--replicate-gb-s", "25"]) == 0
    assert "replicate axis, 25 GB/s" in capsys.readouterr().out
    for extra, message in (
        (["--gpu-memory", "h300"], "--gpu-memory: 'h300' is neither a memory size in GiB"),
        (["--gpu-memory", "-8"], "--gpu-memory: '-8' is neither"),
        (["--tp-gb-s", "100"], "give --gpu-memory as well"),
        (["--gpu-memory", "80", "--shard-gb-s", "0"], "--shard-gb-s must be > 0"),
    ):
        with pytest.raises(SystemExit) as raised:
            main([config, "--ranks", "8", *extra])
        assert raised.value.code == 2
        assert message in capsys.readouterr().err


def test_config_sizes_that_do_not_fit_together_exit_2_naming_the_field(tmp_path, capsys) -> None:
    config = _config(tmp_path, hidden_size=8192, num_attention_heads=64, num_key_value_heads=7)
    line = _error([config, "--ranks", "8", "--gpu-memory", "80"], capsys)
    assert (
        f"config field 'num_key_value_heads' (7) in '{config}' does not divide "
        "'num_attention_heads' (64)" in line
    )
    config = _config(tmp_path, num_attention_heads=30, num_key_value_heads=5)
    line = _error([config, "--ranks", "8"], capsys)
    assert f"'num_attention_heads' (30) in '{config}' does not divide 'hidden_size' (4096)" in line
    # With head_dim given, the heads need not split hidden_size (transformers builds them so).
    shapes = model_shapes(
        {**LLAMA_3_8B, "num_attention_heads": 30, "num_key_value_heads": 5, "head_dim": 128}
    )
    q = next(it for it in shapes.dedicated if it.name.endswith("q_proj.weight"))
    assert q.shape == (30 * 128, 4096)
    missing = {k: v for k, v in LLAMA_3_8B.items() if k != "intermediate_size"}
    (tmp_path / "config.json").write_text(json.dumps(missing))
    line = _error([str(tmp_path), "--ranks", "8"], capsys)
    assert (
        f"config of model_type 'llama' in '{tmp_path / 'config.json'}' has no "
        "'intermediate_size'" in line
    )
    untyped = {k: v for k, v in LLAMA_3_8B.items() if k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps(untyped))
    line = _error([str(tmp_path), "--ranks", "8"], capsys)
    assert f"config in '{tmp_path / 'config.json'}' has no 'model_type'" in line


def test_gpu_errors_from_python() -> None:
    with pytest.raises(ValueError, match=r"forecast: bandwidth sets the mesh axes' GB/s on a GPU"):
        forecast(LLAMA_3_8B, Topology(8), bandwidth={"shard": 100.0})
    with pytest.raises(ValueError, match=r"bandwidth: unknown mesh axes \['pipeline'\]"):
        forecast(LLAMA_3_8B, Topology(8), gpu="h200", bandwidth={"pipeline": 100.0})
    with pytest.raises(ValueError, match=r"bandwidth: tp must be GB/s > 0, got True"):
        forecast(LLAMA_3_8B, Topology(8), gpu="h200", bandwidth={"tp": True})
    with pytest.raises(ValueError, match=r"gpu: 'H100' is neither a memory size in GiB"):
        forecast(LLAMA_3_8B, Topology(8), gpu="H100")
    scaled = load_ns_times().scaled(GPUS["h200"], GPUS["a100-40g"])
    assert scaled.predict_ms(1, 4096, 4096) == pytest.approx(
        load_ns_times().predict_ms(1, 4096, 4096) * 989.4 / 312.0
    )
    assert scaled.stream_gb_s == pytest.approx(4000 * 1555 / 4800)
    with pytest.raises(ValueError, match=r"NSTimes.scaled: this table is already scaled"):
        scaled.scaled(GPUS["h200"], GPUS["a100-80g"])
    # A named card is case-blind; a number is that much memory with the H200's rates.
    assert forecast(LLAMA_3_8B, Topology(8), gpu=" A100-40G").fit.gpu == GPUS["a100-40g"]
    sized = forecast(LLAMA_3_8B, Topology(8), gpu="24").fit.gpu
    assert (sized.memory_gib, sized.bf16_tflops) == (24.0, GPUS["h200"].bf16_tflops)
