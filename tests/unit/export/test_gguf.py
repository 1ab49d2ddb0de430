"""The GGUF export (``lmforge export ... --format gguf``) read back by transformers' GGUF
loader, which turns the file into a transformers model again (q/k rows un-permuted, the
tokenizer rebuilt): equal logits for every Llama-shaped family (tied and untied, GQA,
biases, q/k norms, an explicit head_dim) in f32 (1e-5) and f16, within a stated bound in
bf16 and q8_0. This is the second check; tests/deploy runs llama.cpp itself. Also: the
tokenizer's metadata (vocabulary, merges, the model's own chat template, the template's
end-of-turn token as EOS), refusals before anything is written, and a checkpoint with
LoRA adapters exported merged."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.hf_models import hf_model_dir
from helpers.real_tokenizers import CHATML_TEMPLATE, save_tokenizer
from lmforge.cli import main
from lmforge.data.tokenizer import load_tokenizer
from lmforge.export.gguf import (LLAMA3_SPLIT, QWEN2_SPLIT, GGUFError, export_gguf,
                                 export_gguf_merged, pre_tokenizer)
from lmforge.models.hf import load_hf_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

FAMILIES = {  # id -> (model_type, config beyond the tiny shape)
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-head_dim24": ("qwen3", {"head_dim": 24}),
}


def model_dir(root, model_type: str, **config):
    """A random transformers model with the ChatML test tokenizer and its template."""
    return hf_model_dir(root, model_type, seed=2, extra_vocab=5, **config)


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family_dir(request, tmp_path_factory):
    model_type, config = FAMILIES[request.param]
    return model_dir(tmp_path_factory.mktemp(request.param), model_type, **config)


def read_back(path):
    """transformers' model from the GGUF file, fp32."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("dtype,tolerance", [("f32", 1e-5), ("f16", 2e-2)])
def test_transformers_reads_the_gguf_back_with_our_logits(family_dir, tmp_path, dtype,
                                                          tolerance):
    out = export_gguf(family_dir, tmp_path / "model.gguf", dtype)
    ours = load_hf_model(family_dir).eval()
    if ours.args.head_dim != ours.args.dim // ours.args.n_heads:
        # transformers' GGUF loader sizes heads as dim / heads, ignoring the file's
        # attention.key_length, which llama.cpp reads (tests/deploy checks llama.cpp)
        reader = gguf.GGUFReader(out)
        assert _field(reader, "qwen3.attention.key_length") == ours.args.head_dim
        pytest.skip("transformers' GGUF loader does not read attention.key_length")
    tokens = torch.randint(0, ours.args.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(read_back(out)(tokens).logits, ours(tokens),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype,bound", [("bf16", 0.2), ("q8_0", 0.6)])
def test_bf16_and_q8_0_stay_within_their_rounding(tmp_path, dtype, bound):
    src = model_dir(tmp_path / "src", "llama")
    out = export_gguf(src, tmp_path / "model.gguf", dtype)
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == dtype.upper()
    assert types["blk.0.attn_norm.weight"] == "F32"  # vectors stay f32
    ours = load_hf_model(src).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (1, 16),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        error = (read_back(out)(tokens).logits - ours(tokens)).abs().max()
    assert 0 < error < bound


def _field(reader, key):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if value.dtype == "uint8" else value.tolist()[0]


def _array(reader, key) -> list:
    field = reader.fields[key]
    return [field.parts[i].tolist()[0] for i in field.data]


def test_the_tokenizer_template_and_end_of_turn_go_into_the_file(tmp_path):
    src = model_dir(tmp_path / "src", "qwen2")
    out = export_gguf(src, tmp_path / "model.gguf", "f16")
    reader = gguf.GGUFReader(out)
    tok = load_tokenizer(src)
    assert _field(reader, "tokenizer.chat_template") == CHATML_TEMPLATE
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tok.token_to_id("<|im_end|>")
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert _field(reader, "general.architecture") == "qwen2"
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == load_hf_model(src).args.vocab_size  # padded to the model's
    assert not _field(reader, "tokenizer.ggml.add_bos_token")  # ChatML adds nothing


def test_gptj_which_llama_cpp_cannot_run_is_refused_saying_so_before_anything_is_written(
        tmp_path):
    from helpers.hf_models import random_hf_gptj

    src = tmp_path / "gptj"
    random_hf_gptj().save_pretrained(src)
    save_tokenizer("chatml", src)
    with pytest.raises(GGUFError, match="no GGUF export of the gptj family .*: llama.cpp "
                                        "cannot run GPT-J"):
        export_gguf(src, tmp_path / "model.gguf")
    with pytest.raises(GGUFError, match="llama.cpp cannot run GPT-J"):  # before the merge
        export_gguf_merged(src, tmp_path / "no-adapter", tmp_path / "merged.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_gemma3_norms_are_written_plus_one_and_its_layers_kinds_and_rope_bases_are_kept(
        tmp_path):
    """llama.cpp multiplies by a norm's weight where Gemma multiplies by (1 + weight); the
    query norm also carries the model's query scale over llama.cpp's 1 / sqrt(head_dim)
    (llama.cpp runs these files: tests/deploy)."""
    config = dict(num_hidden_layers=4, head_dim=20, intermediate_size=88, sliding_window=6,
                  query_pre_attn_scalar=18, rope_theta=50_000.0, rope_local_base_freq=500.0,
                  sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf_model_dir(tmp_path, "gemma3_text", seed=2, **config)
    reader = gguf.GGUFReader(export_gguf(tmp_path, tmp_path / "m.gguf", "f32"))
    assert _field(reader, "general.architecture") == "gemma3"
    assert [bool(v) for v in _array(reader, "gemma3.attention.sliding_window_pattern")] == [
        True, False, True, False]
    assert _field(reader, "gemma3.attention.sliding_window") == 6
    assert _field(reader, "gemma3.rope.freq_base_swa") == 500.0
    assert _field(reader, "gemma3.rope.freq_base") == 50_000.0
    assert _field(reader, "gemma3.rope.scaling.type") == "linear"
    assert _field(reader, "gemma3.rope.scaling.factor") == 4.0
    assert _field(reader, "gemma3.attention.key_length") == 20
    hf = load_hf_model(tmp_path).state_dict()
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    assert "output.weight" not in stored  # tied
    torch.testing.assert_close(stored["blk.1.post_ffw_norm.weight"],
                               hf["layers.1.post_ffn_norm.weight"] + 1)
    torch.testing.assert_close(stored["blk.0.attn_q_norm.weight"],
                               (hf["layers.0.attention.q_norm.weight"] + 1) * (20 / 18) ** 0.5)
    torch.testing.assert_close(stored["blk.0.attn_k_norm.weight"],
                               hf["layers.0.attention.k_norm.weight"] + 1)


def test_lora_merge_format_gguf_writes_the_merged_model_as_one_file(tmp_path, capsys):
    from lmforge.config import LoraConfig
    from lmforge.peft import apply_lora, export_merged, lora_layers, save_adapter

    src = model_dir(tmp_path / "src", "qwen2", tie_word_embeddings=True)
    model = load_hf_model(src)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0, targets="all-linear"))
    for layer in lora_layers(model).values():
        layer.lora_b.data.normal_(0, 0.5)
    save_adapter(model, tmp_path / "adapter", base_model_path=str(src))
    assert main(["lora", "merge", "--model", str(src), "--adapter", str(tmp_path / "adapter"),
                 "--output", str(tmp_path / "merged.gguf"), "--format", "gguf",
                 "--gguf-dtype", "f32"]) == 0
    assert "merged.gguf (GGUF, f32)" in capsys.readouterr().out
    export_merged(model, tmp_path / "merged", tokenizer=load_tokenizer(src))
    direct = export_gguf(tmp_path / "merged", tmp_path / "direct.gguf", "f32")
    merged = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "merged.gguf").tensors}
    expected = {t.name: t.data for t in gguf.GGUFReader(direct).tensors}
    assert merged.keys() == expected.keys()
    for name, data in expected.items():
        torch.testing.assert_close(torch.from_numpy(merged[name].copy()),
                                   torch.from_numpy(data.copy()), rtol=1e-6, atol=1e-6)
    assert not list(tmp_path.glob(".merged.gguf*"))  # the temporary HF directory is gone


def test_the_cli_exports_a_model_directory_and_refuses_a_bad_dtype(tmp_path, capsys):
    src = model_dir(tmp_path / "src", "llama")
    assert main(["export", str(src), str(tmp_path / "m.gguf"), "--format", "gguf",
                 "--gguf-dtype", "f32"]) == 0
    assert "exported gguf (f32)" in capsys.readouterr().out
    assert (tmp_path / "m.gguf").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["export", str(src), str(tmp_path / "n.gguf"), "--format", "gguf",
              "--gguf-dtype", "q4_k"])


def test_a_lora_gguf_holds_each_adapted_weights_a_and_b_under_the_base_tensors_name(
        tmp_path, capsys):
    from lmforge.config import LoraConfig
    from lmforge.peft import apply_lora, lora_layers, save_adapter

    src = model_dir(tmp_path / "src", "llama")
    model = load_hf_model(src)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0, targets=["q_proj", "v_proj"]))
    for layer in lora_layers(model).values():
        layer.lora_b.data.fill_(1.0)
    save_adapter(model, tmp_path / "adapter", base_model_path=str(src))
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "lora.gguf"),
                 "--format", "gguf-lora", "--gguf-dtype", "f32"]) == 0
    reader = gguf.GGUFReader(tmp_path / "lora.gguf")
    assert _field(reader, "general.type") == "adapter"
    assert _field(reader, "adapter.type") == "lora"
    assert _field(reader, "adapter.lora.alpha") == 0.0  # llama.cpp: scale 1, folded into B
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert set(shapes) == {f"blk.{i}.{p}.weight.lora_{ab}" for i in range(2)
                           for p in ("attn_q", "attn_v") for ab in "ab"}
    assert shapes["blk.0.attn_q.weight.lora_a"] == (64, 4)  # ggml order: (in, rank)
    b = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight.lora_b")
    assert float(b.data.max()) == pytest.approx(8.0 / 4)  # alpha / r folded into B


def test_a_yarn_extended_model_is_refused_before_anything_is_written(tmp_path):
    src = model_dir(tmp_path / "src", "qwen2", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    with pytest.raises(GGUFError, match="YaRN RoPE scaling is not written to GGUF yet"):
        export_gguf(src, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


# ------------------------------------------------------------ llama.cpp's metadata

GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                   "use_regex": True}


def with_pre_tokenizer(model: Path, out: Path, pre_tokenizer: dict, clean_up: bool = False,
                       **bpe) -> Path:
    """A copy of ``model`` whose tokenizer.json splits text with ``pre_tokenizer`` (its BPE
    model's fields updated by ``bpe``) and whose tokenizer_config.json sets
    clean_up_tokenization_spaces."""
    shutil.copytree(model, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = pre_tokenizer
    spec["model"].update(bpe)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = clean_up
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def regex_then_bytes(*regexes: str) -> dict:
    """A Sequence pre-tokenizer: each regex splits in turn, then bytes map to symbols."""
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
               "invert": False} for r in regexes]
    return {"type": "Sequence", "pretokenizers": [*splits, {**GPT2_BYTE_LEVEL,
                                                            "use_regex": False}]}


DIGITS_THEN_GPT2 = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, GPT2_BYTE_LEVEL]}
NAMED_SPLITS = {  # id -> (pre_tokenizer, clean_up_tokenization_spaces, BPE fields, name)
    "gpt2": (GPT2_BYTE_LEVEL, False, {}, "gpt-2"),
    "digits-then-gpt2 (SmolLM)": (DIGITS_THEN_GPT2, False, {}, "smollm"),
    "digits-then-gpt2 cleaned (StarCoder)": (DIGITS_THEN_GPT2, True, {}, "starcoder"),
    "llama3": (regex_then_bytes(LLAMA3_SPLIT), True, {"ignore_merges": True}, "llama-bpe"),
    "qwen2": (regex_then_bytes(QWEN2_SPLIT), False, {}, "qwen2"),
}


@pytest.mark.parametrize("case", sorted(NAMED_SPLITS))
def test_the_pre_tokenizer_is_named_by_how_it_splits_text(tmp_path, case):
    """Identified from the pieces the tokenizer makes of a probe text, not from its
    family: the same name llama.cpp's converter finds for SmolLM2 (smollm), Llama 3
    (llama-bpe), Qwen2 (qwen2) and GPT-2 (gpt-2)."""
    pre, clean_up, bpe, name = NAMED_SPLITS[case]
    src = with_pre_tokenizer(model_dir(tmp_path / "src", "llama"), tmp_path / "m", pre,
                             clean_up, **bpe)
    assert pre_tokenizer(src) == name
    reader = gguf.GGUFReader(export_gguf(src, tmp_path / "m.gguf", "f32"))
    assert _field(reader, "tokenizer.ggml.pre") == name


@pytest.mark.parametrize("kind", ["chatml", "llama3", "lmforge-trained"])
def test_the_test_tokenizers_split_as_gpt2(tmp_path, kind):
    if kind == "lmforge-trained":
        from helpers.real_tokenizers import corpus
        from lmforge.data.tokenizer import train_bpe

        train_bpe(corpus(), 300).save(tmp_path)
    else:
        save_tokenizer(kind, tmp_path)
    assert pre_tokenizer(tmp_path) == "gpt-2"


REFUSED_SPLITS = {  # id -> (pre_tokenizer, BPE fields, what the refusal says)
    "a space added before the text": ({**GPT2_BYTE_LEVEL, "add_prefix_space": True}, {},
                                      r"'Hello' as 'ĠHello', where GPT-2's is 'Hello'"),
    "digits in runs": ({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False}, GPT2_BYTE_LEVEL]}, {},
        r"' ' as 'Ġ', where GPT-2's is ' 2024' as 'Ġ2024'"),
    "a regex llama.cpp has no name for": (regex_then_bytes(r"\p{N}{1,2}|\p{L}+|\s+|[^\s]"),
                                          {}, r"splits text unlike any pre-tokenizer"),
    "no byte-level symbols": ({"type": "Split", "pattern": {"Regex": QWEN2_SPLIT},
                               "behavior": "Isolated", "invert": False}, {},
                              r"' world' as ' world', where GPT-2's is ' world' as 'Ġworld'"),
    "sentencepiece-style": ({"type": "Metaspace", "replacement": "\u2581",
                             "prepend_scheme": "first", "split": True}, {},
                            r"'Hello' as '▁Hello'"),
    "llama3's split without ignore_merges": (
        regex_then_bytes(LLAMA3_SPLIT), {"ignore_merges": False},
        r"model\.ignore_merges is False where llama\.cpp's 'llama-bpe' pre-tokenizer"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_SPLITS))
def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused_before_writing(tmp_path,
                                                                              case):
    pre, bpe, message = REFUSED_SPLITS[case]
    src = with_pre_tokenizer(model_dir(tmp_path / "src", "llama"), tmp_path / "m", pre,
                             **bpe)
    with pytest.raises(GGUFError, match=message):
        export_gguf(src, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_general_keys_head_size_and_special_tokens_are_written_as_llama_cpps_converter(
        tmp_path):
    """general.* from the directory's name and model card, the size label from the
    tensors, recommended sampling from generation_config.json (all through the gguf
    package's Metadata, as the converter); llama's vocab_size and key/value length; the
    unknown token the tokenizer names, and no padding token where none is named.
    tests/deploy compares every key with the converter's own file."""
    src = model_dir(tmp_path / "SmolLM2-135M-Instruct", "llama")
    (src / "README.md").write_text("---\nlicense: apache-2.0\ntags: [chat]\n---\n# card\n")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config,
                                                           "unk_token": "<|endoftext|>"}))
    (src / "generation_config.json").write_text(json.dumps({"temperature": 0.2,
                                                            "top_p": 0.9}))
    reader = gguf.GGUFReader(export_gguf(src, tmp_path / "m.gguf", "q8_0"))
    assert list(reader.fields)[3:5] == ["general.architecture", "general.type"]
    assert _field(reader, "general.type") == "model"
    assert _field(reader, "general.name") == "SmolLM2 135M Instruct"
    n = sum(int(t.n_elements) for t in reader.tensors)  # (the name's "135M" is not this)
    assert _field(reader, "general.size_label") == gguf.size_label(n, n, 0, 0) == "151K"
    assert _field(reader, "general.license") == "apache-2.0"
    assert _field(reader, "general.quantization_version") == gguf.GGML_QUANT_VERSION
    assert _field(reader, "general.sampling.temp") == pytest.approx(0.2)
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    args = load_hf_model(src).args
    assert _field(reader, "llama.vocab_size") == args.vocab_size
    assert _field(reader, "llama.attention.key_length") == args.head_dim
    assert _field(reader, "llama.attention.value_length") == args.head_dim
    tok = load_tokenizer(src)
    assert _field(reader, "tokenizer.ggml.unknown_token_id") == tok.token_to_id("<|endoftext|>")
    assert "tokenizer.ggml.padding_token_id" not in reader.fields


def test_a_size_label_is_counted_from_the_tensors_where_the_name_has_none(tmp_path):
    src = model_dir(tmp_path / "model", "llama")
    reader = gguf.GGUFReader(export_gguf(src, tmp_path / "m.gguf", "f32"))
    n = sum(int(t.n_elements) for t in reader.tensors)
    assert _field(reader, "general.name") == "Model"  # (the converter's title case)
    assert _field(reader, "general.size_label") == gguf.size_label(n, n, 0, 0)


# ------------------------------------------------------------ mixtures of experts

MOE = dict(num_experts_per_tok=2, num_hidden_layers=2)
DEEPSEEK = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10, intermediate_size=96,
                moe_intermediate_size=32, n_routed_experts=8, first_k_dense_replace=1,
                q_lora_rank=24, n_group=4, topk_group=2)
MOE_FAMILIES = {  # id -> (model_type, config, GGUF architecture, keys beyond the counts)
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts=8, moe_intermediate_size=32,
                                    norm_topk_prob=True),
                  "qwen3moe", {"expert_feed_forward_length": 32, "feed_forward_length": 192}),
    "mixtral": ("mixtral", dict(MOE, num_local_experts=8, intermediate_size=32), "llama",
                {"feed_forward_length": 32}),
    "deepseek_v3": ("deepseek_v3", dict(MOE, **DEEPSEEK), "deepseek2", {
        "expert_feed_forward_length": 32, "feed_forward_length": 96, "expert_group_count": 4,
        "expert_group_used_count": 2, "expert_gating_func": 2,  # sigmoid
        "leading_dense_block_count": 1, "expert_shared_count": 1,
        "attention.head_count_kv": 1, "attention.kv_lora_rank": 16,
        "attention.q_lora_rank": 24, "attention.key_length": 16 + 4,
        "attention.value_length": 16, "attention.key_length_mla": 8 + 4,
        "attention.value_length_mla": 10, "rope.dimension_count": 4}),
    "gpt_oss": ("gpt_oss", dict(MOE, num_local_experts=8, intermediate_size=32, head_dim=16,
                                sliding_window=6),
                "gpt-oss", {"expert_feed_forward_length": 32, "attention.sliding_window": 6,
                            "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                            "attention.key_length": 16}),
}


@pytest.mark.parametrize("case", sorted(MOE_FAMILIES))
def test_each_layers_experts_are_stacked_and_its_router_kept_in_f32(tmp_path, case):
    """The experts of a layer as one (experts, out, in) tensor per projection, gate and
    up apart, as llama.cpp's converter stacks them; the router in f32 in an f16 file, as
    the converter keeps it (tests/deploy compares every key and tensor with the
    converter's and runs the file in llama.cpp)."""
    model_type, config, arch, keys = MOE_FAMILIES[case]
    src = model_dir(tmp_path / "model", model_type, **config)
    reader = gguf.GGUFReader(export_gguf(src, tmp_path / "m.gguf", "f16"))
    assert _field(reader, "general.architecture") == arch
    for key, value in {"expert_count": 8, "expert_used_count": 2, **keys}.items():
        assert _field(reader, f"{arch}.{key}") == value, key
    model = load_hf_model(src)
    last = model.args.n_layers - 1
    ours = {k: v for k, v in model.state_dict().items() if k.startswith(f"layers.{last}.")}
    gate_up = ours[f"layers.{last}.feed_forward.experts.gate_up_proj"]
    width = gate_up.shape[1] // 2
    expected = {"ffn_gate_exps": gate_up[:, :width], "ffn_up_exps": gate_up[:, width:],
                "ffn_down_exps": ours[f"layers.{last}.feed_forward.experts.down_proj"],
                "ffn_gate_inp": ours[f"layers.{last}.feed_forward.gate.weight"]}
    stored = {t.name: t for t in reader.tensors}
    for name, tensor in expected.items():
        t = stored[f"blk.{last}.{name}.weight"]
        router = name == "ffn_gate_inp"
        assert t.tensor_type.name == ("F32" if router else "F16"), name
        torch.testing.assert_close(torch.from_numpy(t.data.astype("float32")),
                                   tensor if router else tensor.half().float(), rtol=0, atol=0)


def test_deepseek_v3s_kv_b_proj_is_split_per_head_as_llama_cpp_reads_it(tmp_path):
    """kv_b_proj's rows, per head (nope, then v), as attn_k_b (heads, latent, nope:
    transposed) and attn_v_b (heads, v, latent), as llama.cpp's converter writes them;
    the correction bias as exp_probs_b.bias."""
    src = model_dir(tmp_path / "model", "deepseek_v3", **MOE, **DEEPSEEK)
    reader = gguf.GGUFReader(export_gguf(src, tmp_path / "m.gguf", "f32"))
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    ours = load_hf_model(src).state_dict()
    kv_b = ours["layers.1.attention.kv_b_proj.weight"].reshape(4, 8 + 10, 16)
    torch.testing.assert_close(stored["blk.1.attn_k_b.weight"], kv_b[:, :8].transpose(1, 2))
    torch.testing.assert_close(stored["blk.1.attn_v_b.weight"], kv_b[:, 8:])
    assert "blk.1.attn_kv_b.weight" not in stored
    torch.testing.assert_close(stored["blk.1.exp_probs_b.bias"],
                               ours["layers.1.feed_forward.gate.e_score_correction_bias"])
    assert "blk.0.ffn_gate.weight" in stored and "blk.0.ffn_gate_exps.weight" not in stored
    assert stored["blk.1.ffn_up_shexp.weight"].shape == (32, 64)


MOE_REFUSED = {  # id -> (model_type, config, what the refusal says)
    "qwen3_moe dense layers": ("qwen3_moe", dict(MOE, num_experts=8, moe_intermediate_size=32,
                                                 norm_topk_prob=True, mlp_only_layers=[0]),
                               r"layers \[0\] have a dense MLP .* llama\.cpp's qwen3moe has "
                               r"experts in every layer"),
    "qwen3_moe raw weights": ("qwen3_moe", dict(MOE, num_experts=8, moe_intermediate_size=32,
                                                norm_topk_prob=False),
                              r"norm_topk_prob is false, and llama\.cpp's qwen3moe always "
                              r"rescales"),
    # (measured in llama.cpp: these give other tokens)
    "deepseek_v3 halves": ("deepseek_v3", dict(MOE, **DEEPSEEK, rope_interleave=False),
                           r"rope_interleave is false .* llama\.cpp's deepseek2 rotates "
                           r"adjacent pairs"),
    "deepseek_v3 q_proj": ("deepseek_v3", dict(MOE, **{**DEEPSEEK, "q_lora_rank": None}),
                           r"q_lora_rank is null .* DeepSeek-V2-Lite's depth \(26 or 27"),
    "gpt_oss swiglu_limit": ("gpt_oss", dict(MOE, num_local_experts=8, intermediate_size=32,
                                             swiglu_limit=5.0),
                             r"swiglu_limit is 5\.0, and llama\.cpp's gpt-oss computes its "
                             r"experts with 7\.0"),
    "gpt_oss layer kinds": ("gpt_oss", dict(MOE, num_local_experts=8, intermediate_size=32,
                                            layer_types=["full_attention",
                                                         "sliding_attention"]),
                            r"layer_types are not sliding and full attention in turn"),
    "deepseek_v3 yarn": ("deepseek_v3", dict(MOE, **DEEPSEEK, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}), r"YaRN RoPE scaling is not written"),
}


@pytest.mark.parametrize("case", sorted(MOE_REFUSED))
def test_an_moe_llama_cpp_would_run_otherwise_is_refused_before_writing(tmp_path, case):
    model_type, config, message = MOE_REFUSED[case]
    src = model_dir(tmp_path / "model", model_type, **config)
    with pytest.raises(GGUFError, match=message):
        export_gguf(src, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))
