"""GGUF exports run in llama.cpp itself (llama-cpp-python, llama.cpp's Python binding;
`make test-deploy` installs it, compiling llama.cpp once): for each Llama-shaped family,
llama.cpp's 32 greedy tokens after a prompt equal lmforge's greedy decode of the same
model, from the f32 and the f16 export; a LoRA GGUF on its base's GGUF gives the merged
model's tokens; a ChatML model fine-tuned to answer and stop
ends llama.cpp's chat completion on <|im_end|> with lmforge's answer, the template in
the file being the model's own. Skipped, saying why, where llama_cpp is not installed."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_models import hf_model_dir
from helpers.runs import run_lmforge
from lmforge.data.templates import get_template
from lmforge.data.tokenizer import load_tokenizer
from lmforge.config import LoraConfig
from lmforge.export.gguf import export_gguf, export_gguf_lora, q8_0_fits
from lmforge.models.generate import generate as decode
from lmforge.models.hf import load_hf_model
from lmforge.peft import apply_lora, export_merged, lora_layers, save_adapter


def generate(model, prompt: list[int], new: int, greedy: bool = True, stop_ids=()) -> list[int]:
    """One prompt's greedy tokens from lmforge's batched decoder."""
    assert greedy
    return decode(model, [prompt], new, stop_ids=stop_ids)[0].ids

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                "(make test-deploy installs it)")
pytestmark = pytest.mark.deploy
NEW_TOKENS = 32
GEMMA3 = dict(num_hidden_layers=4, head_dim=20, intermediate_size=88, sliding_window=6,
              query_pre_attn_scalar=18, rope_theta=50_000.0, rope_local_base_freq=500.0)
FAMILIES = {
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-head_dim24": ("qwen3", {"head_dim": 24}),
    "phi3-fused": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}),
    # Gemma 3: a window shorter than the prompt and the 32 tokens, a query scale that is
    # not 1 / sqrt(head_dim), the sliding layers' own RoPE base, and (second) per-layer
    # kinds out of the pattern with the global layers' linear RoPE factor, untied
    "gemma3-pattern2": ("gemma3_text", GEMMA3 | {"sliding_window_pattern": 2}),
    "gemma3-layer-types-linear-untied": ("gemma3_text", GEMMA3 | {
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                        "full_attention"], "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "tie_word_embeddings": False}),
}
ORIGINAL = 16  # original_max_position_embeddings of the LongRoPE case


def _run(path, prompt: list[int], n: int = NEW_TOKENS, **kwargs) -> list[int]:
    """llama.cpp's greedy continuation of ``prompt`` (top-k 1, no repeat penalty)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False,
                          seed=0, **kwargs)
    out = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            break
    return out


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family_dir(request, tmp_path_factory):
    model_type, config = FAMILIES[request.param]
    # (llama.cpp keys special-token rules on general.name, the directory's name: a name
    # with "phi3" in it makes it look for Phi-3's own tokens, which the test tokenizer
    # lacks)
    return hf_model_dir(tmp_path_factory.mktemp("model") / "model", model_type, seed=3,
                        **config)


def as_stored(model, dtype: str):
    """``model`` with its matrices rounded as the GGUF file stores them (vectors stay
    f32), so that llama.cpp and lmforge compute with the same numbers."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() != 2 or dtype == "f32":
                continue
            if dtype == "f16" or not q8_0_fits(p.shape):
                p.copy_(p.to(torch.float16).float())
            else:  # q8_0: quantized and read back as the file holds it
                packed = gguf.quantize(p.numpy(), q8)
                p.copy_(torch.from_numpy(gguf.dequantize(packed, q8)).reshape(p.shape))
    return model


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_greedy_tokens_equal_lmforges(family_dir, tmp_path, dtype):
    out = export_gguf(family_dir, tmp_path / "model.gguf", dtype)
    ours = as_stored(load_hf_model(family_dir), dtype)
    prompt = torch.randint(0, ours.args.vocab_size - 10, (6,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    expected = generate(ours, prompt, NEW_TOKENS, greedy=True)
    assert _run(out, prompt) == expected


def test_q8_0_greedy_tokens_agree_with_lmforges_until_rounding_flips_a_near_tie(
        family_dir, tmp_path):
    """q8_0 rounds each weight to 8 bits per block of 32, and llama.cpp's q8_0 matmul
    rounds the activations too. lmforge decodes with the weights as the file holds them;
    on these random tiny models, whose next-token distributions are nearly flat, 3 to 32
    of the 32 tokens agreed (the 7 families, measured: 13, 19, 19, 3, 12, 7, 32). The
    stated bound: the first 2 agree."""
    out = export_gguf(family_dir, tmp_path / "model.gguf", "q8_0")
    ours = as_stored(load_hf_model(family_dir), "q8_0")
    prompt = torch.randint(0, ours.args.vocab_size - 10, (6,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    got, want = _run(out, prompt), generate(ours, prompt, NEW_TOKENS, greedy=True)
    assert got[:2] == want[:2]


def test_phi3_longrope_equals_lmforge_past_the_pretraining_length(tmp_path):
    """LongRoPE's long factors (a sequence past original_max_position_embeddings). Below
    it the two differ by design: llama.cpp picks the factors by its context size, which
    it rounds up to 256 tokens, and lmforge (as transformers) by the sequence's length."""
    tmp_path = tmp_path / "model"  # (a neutral name: see family_dir)
    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(4)],
            "long_factor": [1.5 + 0.7 * i for i in range(4)],
            "original_max_position_embeddings": ORIGINAL}
    hf_model_dir(tmp_path, "phi3", seed=3, partial_rotary_factor=0.5, rope_scaling=rope,
                 original_max_position_embeddings=ORIGINAL)
    out = export_gguf(tmp_path, tmp_path / "model.gguf", "f32")
    ours = load_hf_model(tmp_path)
    prompt = torch.randint(0, ours.args.vocab_size - 10, (ORIGINAL + 2,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    assert _run(out, prompt, 16) == generate(ours, prompt, 16, greedy=True)


@pytest.mark.parametrize("model_type,rslora", [("llama", False), ("qwen2", True)])
def test_a_lora_gguf_on_its_base_equals_the_merged_export(tmp_path, model_type, rslora):
    """Adapters on every projection (q/k's B rows permuted like the weights for llama's
    rotation; each module's scaling, rsLoRA's too, folded into B)."""
    base = hf_model_dir(tmp_path / "base", model_type, seed=4)
    model = load_hf_model(base)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0, rslora=rslora,
                                 targets="all-linear"))
    g = torch.Generator().manual_seed(0)
    for layer in lora_layers(model).values():  # adapters that change the greedy tokens
        layer.lora_b.data = torch.randn(layer.lora_b.shape, generator=g) * 0.3
    adapter = save_adapter(model, tmp_path / "adapter", base_model_path=str(base))
    merged = export_merged(model, tmp_path / "merged", tokenizer=load_tokenizer(base),
                           dtype=torch.float32)
    base_gguf = export_gguf(base, tmp_path / "base.gguf", "f32")
    lora_gguf = export_gguf_lora(adapter, base, tmp_path / "lora.gguf")
    merged_gguf = export_gguf(merged, tmp_path / "merged.gguf", "f32")
    prompt = [5, 17, 33, 2, 9, 40]
    expected = generate(model, prompt, NEW_TOKENS, greedy=True)
    assert expected != generate(load_hf_model(base), prompt, NEW_TOKENS, greedy=True)
    assert _run(merged_gguf, prompt) == expected
    assert _run(base_gguf, prompt, lora_path=str(lora_gguf)) == expected


CHAT = [{"role": "user", "content": "say hi"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny ChatML model fine-tuned until it answers "hello there" and stops."""
    root = tmp_path_factory.mktemp("chatml")
    base = hf_model_dir(root / "base", seed=1)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT + [
        {"role": "assistant", "content": "hello there"}]}) + "\n" for _ in range(64)))
    run_lmforge(root / "run", [f"model.init_from={base}", "data.kind=sft",
                               f"data.path={data}", "data.seq_len=32", "data.eval_fraction=0",
                               "data.micro_batch_size=8", "train.max_steps=40",
                               "optim.lr=3e-3", "train.sample_prompt=null"])
    return root / "run" / "hf"


def test_the_chatml_export_stops_on_im_end_with_lmforges_answer(chat_model, tmp_path):
    out = export_gguf(chat_model, tmp_path / "chat.gguf", "f32")
    tok = load_tokenizer(chat_model)
    template = get_template("auto", tok)
    ours = generate(load_hf_model(chat_model), template.prompt_ids(CHAT, tok), 16,
                    greedy=True, stop_ids=(template.end_of_turn_id(tok),))
    answer = tok.decode(ours[:-1])  # (without the end-of-turn token)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=128, n_threads=1, verbose=False)
    assert llm.metadata["tokenizer.chat_template"] == tok.chat_template
    reply = llm.create_chat_completion(messages=CHAT, max_tokens=16, temperature=0.0,
                                       top_k=1, repeat_penalty=1.0)
    choice = reply["choices"][0]
    assert ours[-1] == tok.token_to_id("<|im_end|>") and answer == "hello there"
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == answer
