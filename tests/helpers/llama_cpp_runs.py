"""llama.cpp on a GGUF file for the deploy tests, each run in its own process: a model
llama.cpp cannot compute aborts the process (a GGML_ASSERT), which is then a failed
assertion quoting ggml's line, not a dead test run. Also the metadata keys of a GGUF
file, and llama.cpp's own converter (convert_hf_to_gguf.py) run on a model directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

F32_CACHE = 0  # GGML_TYPE_F32: keys and values cached as lmforge keeps them

_GREEDY = """
import json, sys
import llama_cpp
path, prompts, n, kwargs = json.loads(sys.argv[1])
outs = []
for prompt in prompts:  # (a fresh context each: a recurrent state cannot be rewound)
    llm = llama_cpp.Llama(model_path=path, verbose=False, **kwargs)
    out = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            break
    outs.append(out)
print(json.dumps(outs))
"""


def greedy_tokens(path, prompts: list[list[int]], n: int, **kwargs) -> list[list[int]]:
    """llama.cpp's ``n`` greedy tokens (top-k 1, no repeat penalty) after each prompt,
    its KV cache in f32 (llama.cpp's default f16 cache rounds keys and values)."""
    kwargs = dict(n_ctx=128, n_threads=1, seed=0, type_k=F32_CACHE, type_v=F32_CACHE) | kwargs
    done = subprocess.run([sys.executable, "-c", _GREEDY,
                           json.dumps([str(path), prompts, n, kwargs])],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        ggml = [line for line in done.stderr.splitlines() if "GGML_ASSERT" in line]
        raise AssertionError(f"llama.cpp exited with {done.returncode} on {path}: "
                             f"{ggml[0] if ggml else done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gguf_keys(path) -> dict:
    """A GGUF file's metadata, key -> value (a list for an array)."""
    import gguf

    reader, out = gguf.GGUFReader(path), {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        values = [field.parts[i] for i in field.data]
        if field.types[-1] == gguf.GGUFValueType.STRING:
            values = [bytes(v).decode() for v in values]
        else:
            values = [v.tolist()[0] for v in values]
        out[key] = values if field.types[0] == gguf.GGUFValueType.ARRAY else values[0]
    return out


def converter_dir(version: str) -> Path:
    """Where scripts/setup_deploy.sh keeps the converter of llama-cpp-python ``version``."""
    wheels = Path(os.environ.get("LMFORGE_WHEELS", Path.home() / ".cache/lmforge/wheels"))
    return Path(os.environ.get("LMFORGE_LLAMA_CPP_CONVERTER",
                               wheels / f"llama.cpp-{version}" / "converter"))


# Run in its own process. The converter names a BPE pre-tokenizer by a hash of the ids a
# published tokenizer gives its reference text; a test vocabulary is in none of its
# lists, so it is handed the name ours found, and everything else is its own. It reaches
# for sentencepiece (not in the pinned set; these directories hold no tokenizer.model)
# before it reads tokenizer.json, and its Phi-3 reads tokenizer.json only for a
# GPT2Tokenizer class: those two paths go straight to its tokenizer.json reader.
CONVERT = """
import runpy, sys
root, pre = sys.argv.pop(1), sys.argv.pop(1)
sys.path.insert(0, root)
import conversion.base as base, conversion.phi as phi
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
def no_sentencepiece(self, *args, **kwargs):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
phi.Phi3MiniModel.set_vocab = base.TextModel._set_vocab_gpt2
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converted(converter: Path, src, out, pre: str, *options: str) -> Path:
    """``src`` through llama.cpp's convert_hf_to_gguf.py (``options``: its own) to ``out``."""
    done = subprocess.run([sys.executable, "-c", CONVERT, str(converter), pre, str(src),
                           "--outfile", str(out), *options],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(out)


# The hybrid families' deploy tests (Qwen3-Next, Qwen3.5-MoE): their prompts, what an f16
# file holds of lmforge's model, and the near tie an f16 run may flip.

# lmforge's names of the matrices export/gguf.py keeps in f32 whatever the file type
# (F32_MATRICES: the convolution's kernel, the routers)
KEPT_F32 = ("conv1d.weight", "feed_forward.gate.weight", "shared_expert_gate.weight")


def prompts(vocab: int, lengths=(1, 6, 70)) -> list[list[int]]:
    """Seeded random prompts of ``lengths`` tokens (70: past a 64-token chunk)."""
    import torch

    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab - 10, (n,), generator=g).tolist() for n in lengths]


def transformers_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy tokens after ``prompt`` (the reference model, f32)."""
    import torch

    from helpers.hf_models import load_reference

    model = load_reference(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def as_stored(model, dtype: str):
    """``model`` with the weights an f16 file holds in f16 rounded so (matrices but
    ``KEPT_F32``; every vector stays f32)."""
    import torch

    if dtype == "f32":
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith(KEPT_F32):
                p.copy_(p.to(torch.float16).float())
    return model


def near_tie(model, prompt: list[int], want: list[int], got: list[int], margin: float,
             router_margin: float = 0.0) -> bool:
    """Whether, where ``got`` first leaves ``want``, its token's logit after the same
    prefix is within ``margin`` of the top one's in ``model``, or (an MoE model) a router
    along that prefix chose its last expert within ``router_margin`` (probability) of the
    first one it left out: rounding that flips an expert changes the logits wholesale."""
    import torch

    from lmforge.models.moe import Router

    first = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    gaps = [float("inf")]

    def router_gap(module, inputs, routing):
        k = routing.indices.shape[-1]
        probs = routing.logits.softmax(-1).topk(k + 1, dim=-1).values
        gaps.append(float((probs[:, k - 1] - probs[:, k]).min()))

    hooks = [m.register_forward_hook(router_gap) for m in model.modules()
             if isinstance(m, Router)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want[:first]]))[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    return (float(logits[want[first]] - logits[got[first]]) < margin
            or min(gaps) < router_margin)


def hybrid_dir(root, model_type: str, **config):
    """``root`` holding the chatml test tokenizer and a tiny random transformers
    ``model_type`` model (``helpers.hf_models``) sized to its vocabulary, its linear
    layers' constants and norms perturbed; returns ``root``."""
    from helpers.hf_models import randomise_linear_attention, random_hf_causal_lm
    from helpers.real_tokenizers import save_tokenizer
    from lmforge.data.tokenizer import load_tokenizer

    save_tokenizer("chatml", root)
    vocab = load_tokenizer(root).vocab_size
    model = random_hf_causal_lm(model_type, seed=3, vocab_size=vocab, **config)
    randomise_linear_attention(model).save_pretrained(root)
    return root


def lmforge_export(src, out, dtype: str):
    """``lmforge export SRC OUT --format gguf --gguf-dtype DTYPE``, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "lmforge.cli", "export", str(src), str(out),
                           "--format", "gguf", "--gguf-dtype", dtype],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(out)


def assert_greedy_as_lmforge(model_dir, out, dtype: str, n: int, margin: float,
                             router_margin: float = 0.0) -> None:
    """llama.cpp's ``n`` greedy tokens from ``out`` (``model_dir`` exported in ``dtype``)
    after ``prompts``: lmforge's (and, from an f32 file, transformers' too); from an f16
    file, lmforge's with its weights as the file holds them, up to a ``near_tie``."""
    from lmforge.models.generate import generate
    from lmforge.models.hf import load_hf_model

    ours = as_stored(load_hf_model(model_dir), dtype)
    asked = prompts(ours.args.vocab_size)
    expected = [generate(ours, [p], n)[0].ids for p in asked]
    if dtype == "f32":
        assert expected == [transformers_greedy(model_dir, p, n) for p in asked]
    got = greedy_tokens(out, asked, n, n_batch=32, n_ubatch=32)
    if dtype == "f32":
        assert got == expected
    for prompt, want, tokens in zip(asked, expected, got):
        assert tokens == want or near_tie(ours, prompt, want, tokens, margin,
                                          router_margin), (tokens, want)


def assert_as_converted(model_dir, tmp_path, arch: str, different_on_purpose=()
                        ) -> tuple[dict, set]:
    """lmforge's f32 export of ``model_dir`` against llama.cpp's converter's
    (--outtype f32 --no-mtp: lmforge's models have no multi-token-prediction layers):
    every key of the converter's in ours with its value but EOS (the chat template's
    end-of-turn token in ours, as for every family) and ``different_on_purpose``; the
    same tensors, byte for byte. Skipped where the converter is not kept. Returns our
    keys and those that differed."""
    import gguf
    import numpy as np
    import pytest

    from lmforge.export.gguf import export_gguf

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    converter = converter_dir(llama_cpp.__version__)
    if not (converter / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {converter} (make test-deploy keeps "
                    f"it there)")
    ours = export_gguf(model_dir, tmp_path / "ours.gguf", "f32")
    ours_keys = gguf_keys(ours)
    assert ours_keys["general.architecture"] == arch
    theirs = converted(converter, model_dir, tmp_path / "theirs.gguf",
                       ours_keys["tokenizer.ggml.pre"], "--outtype", "f32", "--no-mtp")
    their_keys = gguf_keys(theirs)
    allowed = {"tokenizer.ggml.eos_token_id", *different_on_purpose}
    differing = {k for k in their_keys if ours_keys.get(k) != their_keys[k]}
    assert differing <= allowed, {k: (ours_keys.get(k), their_keys[k])
                                  for k in differing - allowed}
    ours_t = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    theirs_t = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    assert ours_t.keys() == theirs_t.keys()
    for name, t in theirs_t.items():
        assert ours_t[name].tensor_type == t.tensor_type, name
        assert np.array_equal(ours_t[name].data, t.data), name
    return ours_keys, differing
