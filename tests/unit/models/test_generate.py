"""The batched decoder: greedy with the cache equals recomputing everything and
transformers' generate; a batch of prompts of different lengths gives each row what it
gives alone; log-probabilities equal a full forward's; sampled rows come from their
seed whatever shares their batch; stops and limits are per row."""
import math

import pytest
import torch

from helpers.hf_models import random_hf_llama
from helpers.hf_parity import assert_greedy_decode_equal
from helpers.tiny_models import tiny_llama_args
from lmforge.models.generate import (Sampling, check_sampling, compiled_shapes, generate,
                                     generate_in_batches, sample)
from lmforge.models.llama import build_llama, materialize

ARGS = tiny_llama_args(vocab_size=53)
SAMPLED = Sampling(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02)
# 8 prompts of different lengths (1 to 15 tokens)
PROMPTS = [[(7 * i + 3 * j) % 50 + 1 for j in range(n)] for i, n in
           enumerate([5, 1, 9, 15, 2, 7, 12, 3])]


def _model(**changes):
    torch.manual_seed(3)
    args = tiny_llama_args(vocab_size=53, **changes)
    return materialize(build_llama(args), "cpu").eval()


@torch.no_grad()
def _full_forward_logprobs(model, prompt, new) -> list[float]:
    ids = torch.tensor([prompt + new])
    logp = torch.log_softmax(model(ids).float(), -1)[0, len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(new)[:, None])[:, 0].tolist()


def test_greedy_with_cache_equals_recomputing_everything():
    model = _model()
    prompt = [1, 5, 9, 2]
    cached = generate(model, [prompt], 12)[0].ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert cached == ids[len(prompt):]


def test_greedy_llama_equals_transformers_alone_and_in_a_batch(tmp_path):
    hf_model = random_hf_llama(seed=2)
    hf_model.save_pretrained(tmp_path)
    assert_greedy_decode_equal(hf_model, tmp_path, [5, 17, 3, 99, 42, 8], 14)


@pytest.mark.parametrize("changes", [{}, {"sliding_window": 6}], ids=["causal", "window6"])
@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_each_row_of_a_batch_of_8_decodes_what_it_decodes_alone(changes, sampling):
    model = _model(**changes)
    seeds = list(range(10, 18))
    alone = [generate(model, [p], 10, sampling, seeds=s)[0] for p, s in zip(PROMPTS, seeds)]
    batch = generate(model, PROMPTS, 10, sampling, seeds=seeds)
    for a, b in zip(alone, batch):
        assert a.ids == b.ids and len(b.ids) == 10
        torch.testing.assert_close(b.model_logprobs, a.model_logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.sampling_logprobs, a.sampling_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_model_logprobs_equal_a_full_forward_over_prompt_and_completion(sampling):
    model = _model()
    for c, p in zip(generate(model, PROMPTS, 9, sampling, seeds=1), PROMPTS):
        expected = _full_forward_logprobs(model, p, c.ids)
        torch.testing.assert_close(c.model_logprobs, expected, rtol=0, atol=1e-5)


def test_sampling_logprobs_are_the_processed_distributions():
    model = _model()
    c = generate(model, [PROMPTS[0]], 6, Sampling(temperature=0.7), seeds=4)[0]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + c.ids])).float()[0, len(PROMPTS[0]) - 1:-1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(c.ids)[:, None])
    torch.testing.assert_close(c.sampling_logprobs, expected[:, 0].tolist(), rtol=0, atol=1e-5)
    assert generate(model, [PROMPTS[0]], 3)[0].sampling_logprobs == [0.0] * 3  # greedy: p = 1


def test_sampled_rows_are_reproducible_and_independent_of_batch_mates():
    model = _model()
    first = generate(model, PROMPTS[:3], 12, SAMPLED, seeds=[5, 6, 7])
    again = generate(model, PROMPTS[:3], 12, SAMPLED, seeds=[5, 6, 7])
    other_mates = generate(model, [PROMPTS[6], PROMPTS[1], PROMPTS[4]], 12, SAMPLED,
                           seeds=[9, 6, 8])
    assert [c.ids for c in first] == [c.ids for c in again]
    assert other_mates[1].ids == first[1].ids
    assert first[0].ids != generate(model, PROMPTS[:1], 12, SAMPLED, seeds=99)[0].ids


def test_stops_and_limits_are_per_row():
    model = _model()
    free = generate(model, PROMPTS[:3], 12, SAMPLED, seeds=[1, 2, 3])
    stop = free[0].ids[4]
    out = generate(model, PROMPTS[:3], [12, 12, 5], SAMPLED, seeds=[1, 2, 3],
                   stop_ids=[[stop], [], []], sync_every=4)
    assert out[0].ids == free[0].ids[:free[0].ids.index(stop) + 1]
    assert out[0].finish_reason == "stop" and out[0].ids[-1] == stop
    assert out[1].ids == free[1].ids and out[1].finish_reason == "length"
    assert out[2].ids == free[2].ids[:5] and out[2].finish_reason == "length"


def test_generation_never_runs_past_max_seq_len():
    model = _model()
    out = generate(model, [[i % 50 for i in range(60)], [1, 2]], 50)
    assert len(out[0].ids) == ARGS.max_seq_len - 60 and out[0].finish_reason == "length"
    assert len(out[1].ids) == 50
    with pytest.raises(ValueError, match=r"prompt 0 has 64 tokens, which leaves no room"):
        generate(model, [[1] * ARGS.max_seq_len], 4)
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        generate(model, [[1], []], 4)


def test_in_batches_keeps_the_input_order_and_each_prompts_tokens():
    model = _model()
    one_batch = generate_in_batches(model, PROMPTS, 6, batch_size=8, sampling=SAMPLED, seed=3)
    seen = []
    by_three = generate_in_batches(model, PROMPTS, 6, batch_size=3, sampling=SAMPLED, seed=3,
                                   progress=lambda done, total, rate: seen.append(done))
    assert [c.ids for c in one_batch] == [c.ids for c in by_three]
    assert one_batch[2].ids == generate(model, [PROMPTS[2]], 6, SAMPLED, seeds=5)[0].ids
    assert seen == [3, 6, 8]


def test_sample_breaks_ties_by_token_id_never_by_the_batch():
    """argmax and top-p's stable sort take the lower id; top-k keeps a tie whole."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    u = torch.tensor([0.999, 0.0])
    greedy, _, _ = sample(logits, Sampling(), None)
    assert greedy.tolist() == [1, 0]
    top1, lp, _ = sample(logits, Sampling(temperature=1.0, top_k=1), u)
    assert top1.tolist() == [2, 0]  # the tie at the k-th kept: 1 and 2 at p = 0.5 each
    torch.testing.assert_close(lp, torch.tensor([math.log(0.5), math.log(0.25)]))
    nucleus, _, _ = sample(logits, Sampling(temperature=1.0, top_p=1e-6), u)
    assert nucleus.tolist() == [1, 0]
    floor, _, _ = sample(logits, Sampling(temperature=1.0, min_p=0.5), torch.tensor([0.0, 0.999]))
    assert floor.tolist() == [1, 3]


@pytest.mark.parametrize("setting,message", [
    (dict(temperature=float("nan")), r"^temperature: nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), r"^temperature: inf must be"),
    (dict(temperature=-0.1), r"^temperature: -0\.1 must be"),
    (dict(top_k=-1), r"^top_k: -1 must be >= 0"),
    (dict(top_p=0.0), r"^top_p: 0\.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"^top_p: 1\.5 must be in"),
    (dict(top_p=float("nan")), r"^top_p: nan must be in"),
    (dict(min_p=float("nan")), r"^min_p: nan must be in \[0, 1\]"),
])
def test_settings_that_cannot_sample_are_refused_before_any_token(setting, message):
    model = _model()
    with pytest.raises(ValueError, match=message):
        generate(model, [[1, 2]], 4, Sampling(**{"temperature": 1.0, **setting}))


def test_check_sampling_names_the_options_of_its_caller():
    names = {"max_new_tokens": "--max-new-tokens", "top_p": "--top-p"}
    with pytest.raises(ValueError, match=r"^--max-new-tokens: 0 must be > 0$"):
        check_sampling(0, 1.0, None, None, names)
    with pytest.raises(ValueError, match=r"^--top-p: 2 must be in \(0, 1\]$"):
        check_sampling(8, 1.0, None, 2, names)


@pytest.mark.slow
@pytest.mark.long  # (make test-long: 20 s of inductor compiling on a fresh clone)
def test_the_compiled_step_decodes_what_the_eager_one_does():
    model = _model()
    eager = generate(model, PROMPTS[:3], 5)
    before = compiled_shapes()
    compiled = generate(model, PROMPTS[:3], 5, compile=True)
    assert [c.ids for c in compiled] == [c.ids for c in eager]
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b.model_logprobs, a.model_logprobs, rtol=0, atol=1e-5)
    generate(model, PROMPTS[3:7], 5, compile=True)  # 4 rows: the same bucket as 3
    assert compiled_shapes() == before + 1


@pytest.mark.long  # (make test-long: inductor compiles a hybrid step, about a minute)
def test_the_compiled_step_decodes_a_hybrid_model_as_the_eager_one_does():
    """A Qwen3.5's linear layers carry a Gated DeltaNet state as their static cache
    (``buffers``: the convolution window and S, advanced in place)."""
    import dataclasses
    from lmforge.models.common import materialize
    from lmforge.models.registry import PRESETS, build_model

    torch.manual_seed(0)
    args = dataclasses.replace(PRESETS["qwen3.5-debug"], vocab_size=64)
    model = materialize(build_model(args), "cpu").eval()
    prompts = [[p % 64 for p in prompt] for prompt in PROMPTS[:3]]
    eager = generate(model, prompts, 5)
    compiled = generate(model, prompts, 5, compile=True)
    assert [c.ids for c in compiled] == [c.ids for c in eager]
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b.model_logprobs, a.model_logprobs, rtol=0, atol=1e-5)


def test_a_cache_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    import lmforge.models.generate as G

    model = _model()
    per_token = 2 * ARGS.n_layers * ARGS.n_kv_heads * ARGS.head_dim * 4
    assert G.cache_bytes(model, 3, 10) == 3 * 10 * per_token
    monkeypatch.setattr(G, "free_bytes", lambda device: 8 * 20 * per_token - 1)
    monkeypatch.setattr(G, "new_caches", lambda *a: pytest.fail("allocated"))
    with pytest.raises(ValueError, match=r"KV cache of 8 rows x 20 positions needs .* lower "
                                         r"the batch size or the new tokens"):
        generate(model, [[1, 2]] * 8, 18)


@pytest.mark.parametrize("base", ["full", "nf4", "int8"])
def test_unmerged_lora_on_any_base_decodes_what_its_full_forward_scores(base):
    """LoRA adapters (non-zero) stay unmerged, on an fp32, NF4 or int8 base: greedy
    tokens are each full forward's argmax and log-probabilities its log-softmax."""
    from lmforge.config import LoraConfig
    from lmforge.peft import apply_lora, lora_layers

    model = _model()
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0, targets="all-linear"))
    if base != "full":
        for layer in lora_layers(model).values():
            layer.quantize_base(base)
    g = torch.Generator().manual_seed(2)
    for layer in lora_layers(model).values():
        layer.lora_b.data.copy_(torch.randn(layer.lora_b.shape, generator=g) * 0.2)
    for c, p in zip(generate(model, PROMPTS[:3], 8), PROMPTS[:3]):
        ids = list(p)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert c.ids == ids[len(p):]
        torch.testing.assert_close(c.model_logprobs, _full_forward_logprobs(model, p, c.ids),
                                   rtol=0, atol=1e-5)


def test_the_host_reads_the_stop_flags_once_every_16_tokens(monkeypatch):
    """No read of a device value per token: the model and sampling stay on the device,
    and the host looks at the 'all done' flag after tokens 16 and 32 of 40."""
    model = _model()
    reads = []
    for name in ("__bool__", "item", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _n=name: reads.append(_n)
                            or _real(self, *a))
    out = generate(model, PROMPTS[:2], 40, SAMPLED, seeds=[1, 2])
    assert len(out[0].ids) == 40
    assert reads == ["__bool__"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "phi3-longrope"])
def test_the_compiled_step_decodes_gemma3s_and_phi3s_special_layers(family, tmp_path):
    """Gemma 3's local and global layers (window 4 of a 19-token prompt), Phi-3's
    LongRoPE past its pretraining length (16): compiled equals eager."""
    from helpers.hf_models import random_hf_causal_lm
    from lmforge.models.hf import load_hf_model

    if family == "gemma3":
        config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      vocab_size=97, sliding_window=4, layer_types=["sliding_attention",
                                                                    "full_attention"])
        hf = random_hf_causal_lm("gemma3_text", seed=4, **config)
    else:
        rotary = 8  # partial_rotary_factor 0.5 of 16 features per head
        factors = [1.0 + i / 4 for i in range(rotary // 2)]
        hf = random_hf_causal_lm("phi3", seed=3, partial_rotary_factor=0.5,
                                 original_max_position_embeddings=16,
                                 rope_scaling={"rope_type": "longrope", "short_factor": factors,
                                               "long_factor": [2 * f for f in factors],
                                               "original_max_position_embeddings": 16})
    hf.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path)
    assert family == "gemma3" or model.args.rope_scaling is not None
    prompts = [[5, 6, 7], list(range(1, 20)), [9]]
    eager, compiled = generate(model, prompts, 12), generate(model, prompts, 12, compile=True)
    assert [c.ids for c in compiled] == [c.ids for c in eager]
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b.model_logprobs, a.model_logprobs, rtol=0, atol=1e-5)
