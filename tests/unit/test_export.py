"""Export: a training checkpoint -> Hugging Face / PEFT / merged directories that
transformers loads with the same logits as our model."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from helpers.hf_models import load_reference
from lmforge.cli import build_parser
from lmforge.checkpoint import CheckpointError, read_model_state, save_checkpoint
from lmforge.config import JobConfig
from lmforge.data.tokenizer import train_bpe
from lmforge.export import export_checkpoint
from lmforge.models.llama import build_llama, materialize

transformers = pytest.importorskip("transformers")

TEXTS = ["def export(model): return model", "hello world, hello lmforge"] * 20


def make_run_dir(tmp_path, tie: bool = False, lora: bool = False, quantize=None):
    """RUN/tokenizer + RUN/checkpoints/step-0000007 saved from a random model."""
    run = tmp_path / "run"
    tokenizer = train_bpe(TEXTS, vocab_size=300)
    tokenizer.save(run / "tokenizer")
    args = tiny_llama_args(vocab_size=tokenizer.vocab_size, tie_embeddings=tie)
    torch.manual_seed(0)
    model = build_llama(args, "meta")
    cfg = JobConfig()
    cfg.model.preset, cfg.model.dim, cfg.model.n_layers = "debug", 32, 2
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 4, 2, 64
    cfg.model.max_seq_len, cfg.model.tie_embeddings = 64, tie
    if lora:
        from lmforge.peft.lora import prepare_model_for_lora

        cfg.lora.enabled, cfg.lora.rank, cfg.lora.alpha = True, 4, 8.0
        cfg.lora.targets = ["q_proj", "down_proj"]
        cfg.lora.quantize = quantize
        prepare_model_for_lora(model, cfg.lora)
    materialize(model, "cpu")
    if lora:
        from lmforge.peft.lora import after_materialize

        after_materialize(model, cfg.lora)
    with torch.no_grad():  # non-trivial norms (and adapters) so every tensor matters
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "lora_b")):
                p.copy_(1 + 0.5 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    path = save_checkpoint(run / "checkpoints", 7, model, optimizer, {"step": 7}, None,
                           cfg.to_dict())
    return run, path, model, tokenizer


def our_logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens)


def hf_logits(out_dir, tokens):
    with torch.no_grad():
        return load_reference(out_dir)(tokens).logits


@pytest.mark.parametrize("tie", [False, True])
def test_hf_export_matches_transformers(tmp_path, tie):
    run, path, model, tokenizer = make_run_dir(tmp_path, tie=tie)
    out = export_checkpoint(path, tmp_path / "hf")
    tokens = torch.tensor([tokenizer.encode("def export(model): hello")])
    torch.testing.assert_close(hf_logits(out, tokens), our_logits(model, tokens),
                               rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").is_file()  # taken from RUN/tokenizer
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_id
    assert config["tie_word_embeddings"] is tie


def test_export_without_recorded_architecture_uses_config_yaml(tmp_path):
    run, path, model, _ = make_run_dir(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["model_args"] = None
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "checksums.json").unlink()  # such old checkpoints recorded no checksums either
    # The run directory works as CHECKPOINT_DIR too: its newest checkpoint is taken.
    out = export_checkpoint(run, tmp_path / "hf", dtype="bf16")
    from lmforge.models.hf import load_hf_model

    loaded = load_hf_model(out)
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16)), name


def test_cli_export_writes_hf_and_refuses_bad_requests_in_one_line(tmp_path, capsys):
    run, path, _, _ = make_run_dir(tmp_path)
    parser = build_parser()
    args = parser.parse_args(["export", str(path), str(tmp_path / "out"), "--format", "hf"])
    assert args.func(args) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    assert "exported hf" in capsys.readouterr().out
    args = parser.parse_args(["export", str(path), str(tmp_path / "adapter"),
                              "--format", "peft"])
    with pytest.raises(CheckpointError, match="peft needs LoRA parameters") as err:
        args.func(args)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        export_checkpoint(tmp_path / "nothing-here", tmp_path / "x")
    with pytest.raises(SystemExit):
        parser.parse_args(["export", str(path), str(tmp_path / "x"), "--format", "onnx"])


def test_lora_checkpoint_exports_merged_with_the_same_logits_and_peft(tmp_path):
    pytest.importorskip("lmforge.peft.adapters")
    from lmforge.peft.adapters import read_adapter

    run, path, model, tokenizer = make_run_dir(tmp_path, lora=True)
    with pytest.raises(CheckpointError, match="LoRA adapters.*--format merged"):
        export_checkpoint(path, tmp_path / "hf")
    merged = export_checkpoint(path, tmp_path / "merged", fmt="merged")
    tokens = torch.tensor([tokenizer.encode("hello lmforge")])
    torch.testing.assert_close(hf_logits(merged, tokens), our_logits(model, tokens),
                               rtol=1e-4, atol=1e-4)
    adapter = export_checkpoint(path, tmp_path / "adapter", fmt="peft")
    config, weights = read_adapter(adapter)
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj"]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(weights[key], model.layers["0"].attention.q_proj.lora_b.detach())


def test_qlora_checkpoint_exports_merged_with_the_same_logits(tmp_path):
    pytest.importorskip("lmforge.peft.quant")
    run, path, model, tokenizer = make_run_dir(tmp_path, lora=True, quantize="nf4")
    assert any(k.endswith("weight_nf4") for k in read_model_state(path))
    merged = export_checkpoint(path, tmp_path / "merged", fmt="merged", dtype="fp32")
    tokens = torch.tensor([tokenizer.encode("hello lmforge")])
    torch.testing.assert_close(hf_logits(merged, tokens), our_logits(model, tokens),
                               rtol=1e-4, atol=1e-4)
