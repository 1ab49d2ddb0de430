"""Tiny random transformers models for the interop and adapter tests, and the one way
the tests load a transformers model from a directory. Every reference model states its
attention implementation ("eager"): transformers' default changes between releases
(5.24 made SDPA GPT-J's), and two implementations agree only within a tolerance."""
from __future__ import annotations

import torch

REFERENCE_ATTENTION = "eager"


def load_reference(model_dir, **kwargs):
    """``transformers.AutoModelForCausalLM`` from ``model_dir`` in fp32, eval mode, with
    the reference attention implementation."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=REFERENCE_ATTENTION,
        **kwargs).eval()


def random_hf_llama(seed: int = 0, **config):
    """A random fp32 ``transformers.LlamaForCausalLM`` in eval mode (eager attention, no
    special tokens); its norm weights are randomised too, so they are exercised.
    ``config``: LlamaConfig fields replacing the defaults below."""
    return random_hf_causal_lm("llama", seed, **config)


def random_hf_causal_lm(model_type: str, seed: int = 0, **config):
    """``random_hf_llama`` for any Llama-shaped ``model_type`` (mistral, qwen2, qwen3):
    the same tiny shape; norm weights and attention biases randomised (transformers
    initialises them to constants, which would hide a mapping mistake)."""
    import transformers

    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=192, vocab_size=102,
                  max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  attn_implementation=REFERENCE_ATTENTION)
    kwargs.update(config)
    torch.manual_seed(seed)
    attn = kwargs.pop("attn_implementation")
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation=attn).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "proj.bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_model_dir(root, model_type: str = "llama", tokenizer: str = "chatml", seed: int = 0,
                 extra_vocab: int = 0, **config):
    """``root`` holding a test tokenizer (``helpers.real_tokenizers``: chatml, llama3, ...)
    and a ``random_hf_causal_lm`` sized to its vocabulary (plus ``extra_vocab`` rows no
    token uses); returns ``root``."""
    from helpers.real_tokenizers import save_tokenizer
    from lmforge.data.tokenizer import load_tokenizer

    save_tokenizer(tokenizer, root)
    vocab = load_tokenizer(root).vocab_size + extra_vocab
    random_hf_causal_lm(model_type, seed, vocab_size=vocab, **config).save_pretrained(root)
    return root


def random_hf_gptj(seed: int = 0, **config):
    """A random fp32 ``transformers.GPTJForCausalLM`` in eval mode (eager attention): the
    tiny shape with partial rotary (8 of 16 features per head) and an explicit MLP width;
    LayerNorm weights and biases, MLP biases and the head's bias randomised (transformers
    initialises them to constants, which would hide a mapping mistake)."""
    import transformers

    kwargs = dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=192, vocab_size=102,
                  n_positions=128, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    kwargs.update(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GPTJConfig(**kwargs), attn_implementation=REFERENCE_ATTENTION).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def randomise_linear_attention(model):
    """A hybrid model (Qwen3.5, Qwen3-Next) with its Gated DeltaNet's A_log and dt_bias and
    its norms perturbed a little: transformers starts them at constants, which would hide
    a mapping mistake. Returns ``model``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "norm.weight", "layernorm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model


_HYBRID_HEADS = dict(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                     linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_conv_kernel_dim=4, num_hidden_layers=4, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=24,
                     shared_expert_intermediate_size=40, initializer_range=0.1)
# The hybrid MoE families' tiny models, which their parity and adapter tests share.
# Qwen3-Next: full attention first, two linear layers in a row, layer 1's MLP dense
# (mlp_only_layers), raw top-k weights. Qwen3.5-MoE: transformers' default pattern (three
# linear layers, then a full one), every layer sparse, tied embeddings. initializer_range
# 0.1: at 0.2 the experts' outputs (scale 18) magnify the Gated DeltaNet's summation-order
# differences to up to 4e-5 of the logits' scale (measured, 3 seeds; 2-5e-6 at 0.1, as the
# dense Qwen3.5's at 0.2).
HYBRID_MOE_CONFIGS = {
    "qwen3_next": dict(_HYBRID_HEADS, mlp_only_layers=[1], norm_topk_prob=False,
                       layer_types=["full_attention", "linear_attention",
                                    "linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(_HYBRID_HEADS, tie_word_embeddings=True,
                             intermediate_size=None),
}


def saved_hybrid_moe(root, model_type: str):
    """(transformers' model, the directory it is saved in) of ``HYBRID_MOE_CONFIGS``'
    ``model_type``, seed 1, its linear layers' constants perturbed."""
    model = randomise_linear_attention(
        random_hf_causal_lm(model_type, seed=1, **HYBRID_MOE_CONFIGS[model_type]))
    model.save_pretrained(root)
    return model, root

