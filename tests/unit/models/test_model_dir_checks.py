"""A model directory is checked before anything computes with it: config.json's shape
fields (every family, each refused naming the field), the shard files an index names
(never outside the directory) and the weights (no NaN or Inf)."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.tiny_models import tiny_llama
from lmforge.models.gptj import GPTJArgs
from lmforge.models.hf import (HFCheckpointError, args_from_hf_config, hf_config_from_args,
                               load_hf_model, read_hf_state_dict, save_hf_model)
from lmforge.models.mapping import check_finite

LLAMA = hf_config_from_args(tiny_llama().args)  # hidden 32, 4 heads over 2 KV heads
GPTJ = hf_config_from_args(GPTJArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4,
                                    vocab_size=97, ffn_dim=128, max_seq_len=64,
                                    rotary_dim=8))
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("config,changes,message", [
    (LLAMA, {"num_attention_heads": 0}, r"num_attention_heads: 0 is not a positive integer"),
    (LLAMA, {"hidden_size": -32}, r"hidden_size: -32 is not a positive integer"),
    (LLAMA, {"hidden_size": "32"}, r"hidden_size: '32' is not a positive integer"),
    (LLAMA, {"num_hidden_layers": 2.5}, r"num_hidden_layers: 2\.5 is not a positive"),
    (LLAMA, {"vocab_size": True}, r"vocab_size: True is not a positive integer"),
    (LLAMA, {"intermediate_size": 0}, r"intermediate_size: 0 is not"),
    (LLAMA, {"max_position_embeddings": -1}, r"max_position_embeddings: -1 is not"),
    (LLAMA, {"num_key_value_heads": 3},
     r"num_attention_heads: 4 is not a multiple of num_key_value_heads \(3\)"),
    (LLAMA, {"hidden_size": 30, "head_dim": None},
     r"hidden_size: 30 is not a multiple of num_attention_heads \(4\)"),
    (LLAMA, {"head_dim": 7}, r"head_dim: 7 .* must be even for RoPE"),
    (LLAMA, {"rms_norm_eps": NAN}, r"rms_norm_eps: nan is not a positive finite number"),
    (LLAMA, {"rms_norm_eps": 0}, r"rms_norm_eps: 0 is not a positive finite number"),
    (LLAMA, {"rope_theta": INF}, r"rope_theta: inf is not a positive finite number"),
    (LLAMA, {"rope_theta": None, "rope_parameters": {"rope_theta": -1.0}},
     r"rope_parameters: rope_theta: -1\.0 is not a positive"),
    (LLAMA, {"rope_scaling": {"rope_type": "llama3", "factor": NAN, "low_freq_factor": 1,
                              "high_freq_factor": 4,
                              "original_max_position_embeddings": 32}},
     r"rope_scaling: factor: nan is not a positive finite number"),
    (LLAMA, {"initializer_range": -0.02}, r"initializer_range: -0\.02 is not a non-negative"),
    (LLAMA, {"tie_word_embeddings": "false"}, r"tie_word_embeddings: 'false' is not true or"),
    (GPTJ, {"n_head": 0}, r"n_head: 0 is not a positive integer"),
    (GPTJ, {"n_embd": 66}, r"n_embd: 66 is not a multiple of n_head \(4\)"),
    (GPTJ, {"n_layer": "2"}, r"n_layer: '2' is not a positive integer"),
    (GPTJ, {"layer_norm_epsilon": INF}, r"layer_norm_epsilon: inf is not a positive finite"),
    (GPTJ, {"rotary_dim": 0}, r"rotary_dim: 0 is not a positive integer"),
])
def test_config_json_shape_fields_are_refused_naming_the_field(config, changes, message):
    with pytest.raises(HFCheckpointError, match=r"^m/config\.json: " + message):
        args_from_hf_config({**config, **changes}, source="m/config.json")


def _saved(tmp_path):
    save_hf_model(tiny_llama(), tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.parametrize("entry,problem", [
    ("../../../etc/passwd", "not a plain file name inside the directory"),
    ("/etc/passwd", "not a plain file name inside the directory"),
    ("sub/model.safetensors", "not a plain file name inside the directory"),
    ("model-1.safetensors", "a link to .*/outside.safetensors, outside the directory"),
])
def test_index_entries_leaving_the_directory_are_refused_naming_index_and_entry(
        tmp_path, entry, problem):
    model = _saved(tmp_path)
    (model / "model.safetensors").rename(model / "model-0.safetensors")
    (tmp_path / "outside.safetensors").write_bytes(b"")
    (model / "model-1.safetensors").symlink_to(tmp_path / "outside.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-0.safetensors",
                            "model.embed_tokens.weight": entry}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError,
                       match=rf"model\.safetensors\.index\.json: weight_map\["
                             rf"'model\.embed_tokens\.weight'\] = '{re.escape(entry)}': "
                             rf"{problem}; refused$"):
        read_hf_state_dict(model)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(tmp_path, value):
    model = _saved(tmp_path)
    sd = load_file(model / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(sd, str(model / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: tensor "
                                                r"model\.layers\.1\.mlp\.up_proj\.weight holds "
                                                r"NaN or Inf values"):
        load_hf_model(model)


def test_a_16_bit_tensor_whose_sum_overflows_is_still_finite():
    big = torch.full((64,), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(big.sum())  # the fast check alone would refuse it
    check_finite({"w": big, "meta": torch.empty(3, device="meta"),
                  "ids": torch.arange(3)}, "m")
    with pytest.raises(HFCheckpointError, match="m: tensor w holds NaN"):
        check_finite({"w": torch.cat([big, torch.tensor([NAN], dtype=torch.float16)])}, "m")

