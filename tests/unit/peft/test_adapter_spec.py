"""An adapter is checked whole before it touches the model: every adapter_config.json field
load_adapter computes with (refused naming the field), the PEFT features it does not
implement, and every tensor against the config and the base model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.peft import AdapterError, apply_lora, load_adapter, lora_layers, save_adapter

NAN, INF = float("nan"), float("inf")
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture
def adapter(lib, tmp_path):
    """A rank-4 adapter on q_proj and v_proj of every layer of ``lib.TINY``."""
    model = lib.tiny_model()
    apply_lora(model, lib.lora_cfg())
    lib.randomize_adapters(model)
    return save_adapter(model, tmp_path / "adapter")


def _edit_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_tensors(adapter, change):
    path = adapter / "adapter_model.safetensors"
    sd = load_file(path)
    change(sd)
    save_file(sd, str(path))


def _refused(lib, adapter, message: str):
    model = lib.tiny_model()
    with pytest.raises(AdapterError, match=message) as err:
        load_adapter(model, adapter)
    assert not lora_layers(model), "the model was changed before the adapter was refused"
    return str(err.value)


@pytest.mark.parametrize("changes,message", [
    ({"r": -4, "lora_alpha": "nan"}, r"r: -4 is not a positive integer"),
    ({"r": 0}, r"r: 0 is not a positive integer"),
    ({"r": "4"}, r"r: '4' is not a positive integer"),
    ({"r": True}, r"r: True is not a positive integer"),
    ({"r": 4.0}, r"r: 4\.0 is not a positive integer"),
    ({"lora_alpha": "nan"}, r"lora_alpha: 'nan' is not a positive finite number"),
    ({"lora_alpha": NAN}, r"lora_alpha: nan is not a positive finite number"),
    ({"lora_alpha": INF}, r"lora_alpha: inf is not a positive finite number"),
    ({"lora_alpha": 0}, r"lora_alpha: 0 is not a positive finite number"),
    ({"lora_alpha": -8}, r"lora_alpha: -8 is not a positive finite number"),
    ({"lora_dropout": 1.0}, r"lora_dropout: 1\.0 is not a probability in \[0, 1\)"),
    ({"lora_dropout": -0.1}, r"lora_dropout: -0\.1 is not a probability"),
    ({"use_rslora": "yes"}, r"use_rslora: 'yes' is not true or false"),
    ({"target_modules": []}, r"target_modules: \[\] is not a non-empty list"),
    ({"target_modules": None}, r"target_modules: None is not a non-empty list"),
    ({"target_modules": [3]}, r"target_modules: \[3\] is not a non-empty list"),
    ({"target_modules": "(["}, r"target_modules: '\(\[' is not a valid regular expression"),
    ({"target_modules": ["nonexistent_proj"]},
     r"target_modules: 'nonexistent_proj' matches no linear layer of the base model that "
     r"takes adapters \(down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj\)"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules: 'lm_head' matches no"),
    ({"target_modules": r".*\.mlp\.nothing"}, r"target_modules: '.*' matches no linear"),
    ({"exclude_modules": 5}, r"exclude_modules: 5 is not a non-empty list"),
    ({"rank_pattern": {"v_proj": 0}}, r"rank_pattern\['v_proj'\]: 0 is not a positive int"),
    ({"rank_pattern": {"(": 4}}, r"rank_pattern: '\(' is not a valid regular expression"),
    ({"rank_pattern": ["v_proj"]}, r"rank_pattern: \['v_proj'\] is not an object"),
    ({"alpha_pattern": {"q_proj": NAN}}, r"alpha_pattern\['q_proj'\]: nan is not a positive"),
    ({"layers_to_transform": [-1]}, r"layers_to_transform: \[-1\] is not a layer index"),
    ({"layers_to_transform": "0"}, r"layers_to_transform: '0' is not a layer index"),
    ({"layers_to_transform": [7]},
     r"layers_to_transform: 7 is not a layer of the base model \(it has 2\)"),
    ({"init_lora_weights": "pissa"}, r"init_lora_weights = 'pissa' is not supported: peft "
                                     r"rewrites the base weights"),
    ({"init_lora_weights": "olora"}, r"init_lora_weights = 'olora' is not supported"),
    ({"init_lora_weights": "loftq"}, r"init_lora_weights = 'loftq' is not supported"),
    ({"use_qalora": True}, r"use_qalora = True is not supported"),
    ({"alora_invocation_tokens": [1, 2]}, r"alora_invocation_tokens = \[1, 2\] is not"),
    ({"arrow_config": {"top_k": 3}}, r"arrow_config = .* is not supported"),
    ({"mystery_setting": 2}, r"mystery_setting = 2 is a setting lmforge does not know"),
])
def test_config_fields_are_refused_naming_the_field(lib, adapter, changes, message):
    _edit_config(adapter, **changes)
    _refused(lib, adapter, r"adapter_config\.json: " + message)


def test_a_config_that_is_not_an_object_is_refused(lib, adapter):
    (adapter / "adapter_config.json").write_text("[1, 2]")
    _refused(lib, adapter, r"adapter_config\.json: top level must be a JSON object")


def test_r_must_match_the_tensors_naming_r_or_rank_pattern(lib, adapter):
    _edit_config(adapter, r=1000000)
    _refused(lib, adapter, r"adapter_config\.json: r: 1000000 does not match the rank 4 of "
                           r"model\.layers\.\d\.self_attn\.[qv]_proj's tensors in "
                           r"adapter_model\.safetensors")
    _edit_config(adapter, r=4, rank_pattern={"v_proj": 2})
    _refused(lib, adapter, r"adapter_config\.json: rank_pattern: 2 does not match the rank 4 "
                           r"of model\.layers\.\d\.self_attn\.v_proj's")


@pytest.mark.parametrize("changes,message", [
    ({"target_modules": ["q_proj"]},
     r"holds weights for model\.layers\.\d\.self_attn\.v_proj, which adapter_config\.json "
     r"does not target \(target_modules: \['q_proj'\]\)$"),
    ({"exclude_modules": ["model.layers.1.self_attn.v_proj"]},
     r"holds weights for model\.layers\.1\.self_attn\.v_proj, which .* \(target_modules: "
     r"\['q_proj', 'v_proj'\]; exclude_modules: \['model\.layers\.1\.self_attn\.v_proj'\]\)"),
    ({"layers_to_transform": [1]},
     r"holds weights for model\.layers\.0\.self_attn\.[qv]_proj, .*layers_to_transform: \[1\]"),
    ({"target_modules": ".*q_proj"},
     r"holds weights for .*v_proj, which .* \(target_modules: '\.\*q_proj'\)"),
])
def test_weights_of_modules_the_config_does_not_target_are_refused(lib, adapter, changes,
                                                                  message):
    _edit_config(adapter, **changes)
    _refused(lib, adapter, r"adapter_model\.safetensors: " + message)


def _set(key, value):
    def change(sd):
        sd[key] = value
    return change


def _poison(key, value):
    def change(sd):
        sd[key].view(-1)[0] = value
    return change


@pytest.mark.parametrize("change,message", [
    (_poison(f"{Q0}.lora_A.weight", NAN), rf"tensor {Q0}\.lora_A\.weight holds NaN or Inf"),
    (_poison(f"{Q0}.lora_B.weight", -INF), rf"tensor {Q0}\.lora_B\.weight holds NaN or Inf"),
    (_set(f"{Q0}.lora_A.weight", torch.zeros(4, 30)),
     r".*q_proj lora_A/lora_B shapes \(4, 30\)/\(64, 4\), expected \(4, 64\)/\(64, 4\) "
     r"\(rank 4; the base layer is 64 -> 64\)"),
    (_set(f"{Q0}.lora_A.weight", torch.zeros(4, 64, dtype=torch.int64)),
     r".*q_proj lora_A is a 2-d torch\.int64 tensor; a floating-point matrix is needed"),
    (_set(f"{Q0}.lora_B.weight", torch.zeros(256)),
     r".*q_proj lora_B is a 1-d torch\.float32 tensor"),
    (lambda sd: sd.update({f"base_model.model.model.layers.9.self_attn.q_proj.lora_{x}.weight":
                           sd[f"{Q0}.lora_{x}.weight"].clone() for x in "AB"}),
     r"model\.layers\.9\.self_attn\.q_proj is not a linear layer of the base model that takes "
     r"adapters"),
    (lambda sd: sd.update({f"base_model.model.lm_head.lora_{x}.weight":
                           sd[f"{Q0}.lora_{x}.weight"].clone() for x in "AB"}),
     r"lm_head is not a linear layer of the base model that takes adapters"),
])
def test_tensors_are_checked_against_the_config_and_the_base(lib, adapter, change, message):
    _edit_tensors(adapter, change)
    _refused(lib, adapter, r"adapter_model\.safetensors: " + message)
