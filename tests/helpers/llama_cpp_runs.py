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
