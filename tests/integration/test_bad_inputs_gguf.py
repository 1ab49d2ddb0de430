"""The GGUF exports' bad inputs (the harness: tests/helpers/bad_inputs.py): ``export
--format gguf`` of a model directory, ``export --format gguf-lora`` of an adapter and
``lora merge --format gguf`` refuse what generate and lora merge refuse (config.json
against the weights, NaN or Inf, a shard index leaving the directory, an adapter that
does not fit its base), before anything is written; and an option the chosen format would
ignore is refused, naming it, instead of being ignored."""
from __future__ import annotations

import pytest

from helpers.bad_inputs import (MERGE, Bad, adapter_config, adapter_with, check_refused,
                                edit_json, edit_tensors, model_with, params, poison,
                                shard_index, write)

pytest.importorskip("gguf")

GGUF = ["export", "{tmp}/model", "{tmp}/m.gguf", "--format", "gguf"]
LORA_GGUF = ["export", "{tmp}/adapter", "{tmp}/l.gguf", "--format", "gguf-lora",
             "--base", "{model}"]
MERGE_GGUF = [*MERGE[:-1], "{tmp}/merged.gguf", "--format", "gguf"]


def drop(name_part: str):
    """``change`` for ``edit_tensors``: the first tensor whose name holds ``name_part``
    is removed."""
    def change(tensors: dict) -> None:
        del tensors[next(k for k in sorted(tensors) if name_part in k)]
    return change


# The model-directory rows of test_bad_inputs.py, on the GGUF export, and siblings.
MODEL_DIRS = [
    Bad("gguf of a broken config.json", GGUF, r"config\.json",
        setup=model_with(write("model/config.json", "{x"))),
    Bad("gguf of zero attention heads", GGUF,
        r"config\.json: num_attention_heads: 0 is not a positive",
        setup=model_with(edit_json("model/config.json", num_attention_heads=0))),
    Bad("gguf of kv heads not dividing heads", GGUF,
        r"config\.json: num_attention_heads: 4 is not a multiple of num_key_value_heads",
        setup=model_with(edit_json("model/config.json", num_key_value_heads=3))),
    Bad("gguf of a nan rms_norm_eps", GGUF, r"config\.json: rms_norm_eps: nan is not",
        setup=model_with(edit_json("model/config.json", rms_norm_eps=float("nan")))),
    Bad("gguf of an infinite rope_theta", GGUF, r"config\.json: rope_theta: inf is not",
        setup=model_with(edit_json("model/config.json", rope_theta=float("inf")))),
    Bad("gguf of a shard path climbing out", GGUF,
        r"model\.safetensors\.index\.json: weight_map\[.*\] = '\.\./\.\./\.\./etc/passwd': "
        r"not a plain file name", setup=model_with(shard_index("../../../etc/passwd"))),
    Bad("gguf of an absolute shard path", GGUF,
        r"model\.safetensors\.index\.json: weight_map\[.*\] = '/etc/passwd': not a plain",
        setup=model_with(shard_index("/etc/passwd"))),
    Bad("gguf of a shard symlink leaving the dir", GGUF,
        r"weight_map\[.*\] = 'model-1\.safetensors': a link to .* outside the directory",
        setup=model_with(shard_index("model-1.safetensors", link="model"))),
    Bad("gguf of nan in a weight", GGUF,
        r"model\.safetensors: tensor model\.layers\.0\.\S+ holds NaN",
        setup=model_with(edit_tensors("model/model.safetensors",
                                      poison("layers.0.self_attn.q_proj", float("nan"))))),
    Bad("gguf of inf in a weight", GGUF,
        r"model\.safetensors: tensor model\.norm\.weight holds NaN or Inf",
        setup=model_with(edit_tensors("model/model.safetensors",
                                      poison("model.norm", float("inf"))))),
    # siblings: config.json and the weights disagree
    Bad("gguf of a config wider than its weights", GGUF,
        r"model\.safetensors: misshaped: model\.layers\.0\.mlp\.gate_proj\.weight \(64, 32\) "
        r"\(expected \(96, 32\)\)",
        setup=model_with(edit_json("model/config.json", intermediate_size=96))),
    Bad("gguf of a weight missing", GGUF,
        r"model\.safetensors: .*model\.layers\.1\.mlp\.down_proj\.weight",
        setup=model_with(edit_tensors("model/model.safetensors",
                                      drop("layers.1.mlp.down_proj")))),
    Bad("gguf of eos_token_id as a string", GGUF,
        r"generation_config\.json: eos_token_id: 'end' is not a token id",
        setup=model_with(edit_json("model/generation_config.json", eos_token_id="end"))),
    # siblings: what the GGUF's general.* keys are read from (as llama.cpp's converter)
    Bad("gguf of a temperature that is not a number", GGUF,
        r"^{tmp}/model/generation_config\.json: temperature: 'hot' is not a finite number",
        setup=model_with(edit_json("model/generation_config.json", temperature="hot"))),
    Bad("gguf of a model card with broken YAML", GGUF,
        r"^{tmp}/model/README\.md: its model card cannot be read",
        setup=model_with(write("model/README.md", "---\nlicense: [mit\n---\n# card\n"))),
    Bad("gguf of a model card whose tags are numbers", GGUF,
        r"^{tmp}/model/README\.md: tags: \[1, 2\] is not a list of strings",
        setup=model_with(write("model/README.md", "---\ntags: [1, 2]\n---\n# card\n"))),
    Bad("gguf of a tokenizer that adds a space before the text", GGUF,
        r"^{tmp}/model/tokenizer\.json: its pre_tokenizer splits text unlike any "
        r"pre-tokenizer llama\.cpp knows by name \(its first piece unlike GPT-2's split: "
        r"'Hello' as 'ĠHello'",
        setup=model_with(edit_json("model/tokenizer.json", pre_tokenizer={
            "type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
            "use_regex": True}))),
    Bad("gguf of a tokenizer that lowercases", GGUF,
        r"^{tmp}/model/tokenizer\.json: normalizer: Lowercase; llama\.cpp normalizes nothing",
        setup=model_with(edit_json("model/tokenizer.json",
                                   normalizer={"type": "Lowercase"}))),
]

# The adapter rows of test_bad_inputs.py, on the LoRA GGUF and the merged GGUF.
ADAPTERS = [
    Bad("gguf-lora of negative r", LORA_GGUF,
        r"adapter_config\.json: r: -4 is not a positive integer",
        setup=adapter_config(r=-4, lora_alpha="nan")),
    Bad("gguf-lora of alpha as the string nan", LORA_GGUF,
        r"adapter_config\.json: lora_alpha: 'nan' is not a positive finite number",
        setup=adapter_config(lora_alpha="nan")),
    Bad("gguf-lora of zero r", LORA_GGUF, r"adapter_config\.json: r: 0 is not a positive",
        setup=adapter_config(r=0)),
    Bad("gguf-lora of r off the tensors' rank", LORA_GGUF,
        r"adapter_config\.json: r: 1000000 does not match the rank 4 of model\.layers\.\d+\.",
        setup=adapter_config(r=1000000)),
    Bad("gguf-lora of a target module the base lacks", LORA_GGUF,
        r"adapter_config\.json: target_modules: 'nonexistent_proj' matches no linear layer",
        setup=adapter_config(target_modules=["nonexistent_proj"])),
    Bad("gguf-lora of weights for an untargeted module", LORA_GGUF,
        r"adapter_model\.safetensors: holds weights for model\.layers\.\d+\.self_attn\."
        r"v_proj, which adapter_config\.json does not target",
        setup=adapter_config(target_modules=["q_proj"])),
    Bad("gguf-lora of a layer the base lacks", LORA_GGUF,
        r"adapter_config\.json: layers_to_transform: 7 is not a layer of the base model",
        setup=adapter_config(layers_to_transform=[0, 7])),
    Bad("gguf-lora of a DoRA adapter", LORA_GGUF,
        r"adapter_config\.json: use_dora = True is not supported",
        setup=adapter_config(use_dora=True)),
    Bad("gguf-lora of nan in an adapter tensor", LORA_GGUF,
        r"adapter_model\.safetensors: tensor base_model\.model\.\S+\.lora_B\.weight holds NaN",
        setup=adapter_with(edit_tensors("adapter/adapter_model.safetensors",
                                        poison("lora_B", float("nan"))))),
    Bad("gguf-lora of an adapter shaped for another base", LORA_GGUF,
        r"adapter_model\.safetensors: model\.layers\.0\.self_attn\.q_proj lora_A/lora_B "
        r"shapes \(4, 16\)/\(32, 4\), expected \(4, 32\)/\(32, 4\)",
        setup=adapter_with(edit_tensors("adapter/adapter_model.safetensors",
                                        lambda t: _halve_inputs(t, "layers.0.self_attn.q_proj")))),
    Bad("merged gguf of an infinite alpha", MERGE_GGUF,
        r"adapter_config\.json: lora_alpha: inf is not a positive finite number",
        setup=adapter_config(lora_alpha=float("inf"))),
    Bad("merged gguf of nan in an adapter tensor", MERGE_GGUF,
        r"adapter_model\.safetensors: tensor base_model\.model\.\S+\.lora_B\.weight holds NaN",
        setup=adapter_with(edit_tensors("adapter/adapter_model.safetensors",
                                        poison("lora_B", float("nan"))))),
    Bad("merged gguf of a target module the base lacks", MERGE_GGUF,
        r"adapter_config\.json: target_modules: 'nonexistent_proj' matches no linear layer",
        setup=adapter_config(target_modules=["nonexistent_proj"])),
]


def _halve_inputs(tensors: dict, module: str) -> None:
    """The module's lora_A with half its input features (an adapter of a narrower base)."""
    name = next(k for k in sorted(tensors) if module in k and "lora_A" in k)
    tensors[name] = tensors[name][:, : tensors[name].shape[1] // 2].contiguous()


# Options the chosen format would ignore (each refused before anything is read).
OPTIONS = [
    Bad("gguf with --dtype",
        ["export", "{model}", "{tmp}/m.gguf", "--format", "gguf", "--dtype", "bf16"],
        r"^--dtype: --format gguf does not read it \(the GGUF's matrices' type is "
        r"--gguf-dtype\)"),
    Bad("gguf-lora with --dtype",
        ["export", "{adapter}", "{tmp}/l.gguf", "--format", "gguf-lora", "--dtype", "fp16"],
        r"^--dtype: --format gguf-lora does not read it"),
    Bad("gguf of a model directory with --tokenizer",
        ["export", "{model}", "{tmp}/m.gguf", "--format", "gguf", "--tokenizer", "{tokenizer}"],
        r"^--tokenizer: --format gguf does not read it here \(the GGUF of a model directory "
        r"holds that directory's own tokenizer\)"),
    Bad("gguf-lora with --tokenizer",
        ["export", "{adapter}", "{tmp}/l.gguf", "--format", "gguf-lora", "--tokenizer",
         "{tokenizer}"],
        r"^--tokenizer: --format gguf-lora does not read it here \(a LoRA GGUF holds no "
        r"tokenizer\)"),
    Bad("gguf with --base",
        ["export", "{model}", "{tmp}/m.gguf", "--format", "gguf", "--base", "{model}"],
        r"^--base: --format gguf does not read it \(it applies to --format gguf-lora\)"),
    Bad("hf export with --gguf-dtype",
        ["export", "{tmp}/run", "{tmp}/out", "--gguf-dtype", "q8_0"],
        r"^--gguf-dtype: --format hf does not read it \(it applies to --format gguf and "
        r"gguf-lora; hf: --dtype\)"),
    Bad("lora merge to gguf with --dtype", [*MERGE_GGUF, "--dtype", "bf16"],
        r"^--dtype: --format gguf does not read it \(it applies to --format hf\)",
        setup=adapter_with()),
    Bad("lora merge to hf with --gguf-dtype", [*MERGE, "--gguf-dtype", "q8_0"],
        r"^--gguf-dtype: --format hf does not read it \(it applies to --format gguf\)",
        setup=adapter_with()),
]

TABLE = MODEL_DIRS + ADAPTERS + OPTIONS


@pytest.mark.parametrize("row", params(TABLE))
def test_gguf_input_is_refused_in_one_line(row: Bad, bad_input_assets, tmp_path, capsys,
                                           monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, bad_input_assets, tmp_path, capsys)
