"""configs/gptj-6b-finetune.yaml runs on the CPU as written, only smaller: the gptj-tiny
preset (50400 embedding rows beside a byte-level tokenizer that adds nothing and has no
chat template, as GPT-J's), tp 2 x FSDP2 dp 2 on 4 gloo processes, activation
checkpointing, SFT with packing. The run trains, and transformers loads its export as a
GPT-J with our logits."""
import json
import random

import pytest
import torch

from helpers.real_tokenizers import save_tokenizer
from helpers.hf_models import load_reference
from helpers.runs import read_metrics, run_lmforge

pytestmark = [pytest.mark.slow, pytest.mark.long]  # (15 s: make test-long)
RECIPE = "configs/gptj-6b-finetune.yaml"


def _sft_data(path):
    rng = random.Random(0)
    words = "the sky is blue and the ground below is green while rivers run".split()
    with path.open("w") as f:
        for _ in range(64):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
            f.write(json.dumps({"prompt": prompt + "?", "response": prompt.upper()}) + "\n")
    return path


def test_gptj_recipe_trains_tp2_fsdp2_on_cpu_and_exports_a_transformers_gptj(tmp_path):
    pytest.importorskip("transformers")
    tokenizer = save_tokenizer("chatml", tmp_path / "tok", template=None)
    data = _sft_data(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    overrides = [RECIPE, "model.preset=gptj-tiny", f"model.tokenizer={tokenizer}",
                 "model.vocab_size=50400", f"data.path={data}", "data.seq_len=64",
                 "data.micro_batch_size=2", "data.global_batch_size=4", "parallel.tp=2",
                 "train.max_steps=4", "train.log_every=1", "train.eval_every=0",
                 "train.checkpoint_every=0", "train.dtype=fp32", "train.sample_tokens=0",
                 "optim.lr=1e-3", "optim.warmup_steps=0"]
    proc = run_lmforge(out, overrides, nproc=4, torchrun=True, timeout=900)
    assert "tp 2" in proc.stdout and "FSDP2" in proc.stdout, proc.stdout[-2000:]
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
    model = load_reference(out / "hf")
    assert type(model).__name__ == "GPTJForCausalLM"
    assert model.config.vocab_size == 50400 and model.config.rotary_dim == 8

    from lmforge.models.hf import load_hf_model
    tokens = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_hf_model(out / "hf")(tokens), model(tokens).logits,
                                   rtol=1e-5, atol=1e-5)
