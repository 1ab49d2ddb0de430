"""llama.cpp's greedy continuation of a prompt, through llama-cpp-python (what
``make test-deploy`` installs): ``python llama_cpp_generate.py MODEL.gguf PROMPT [N]``
prints the prompt and at most N new tokens, stopping at the model's end-of-sequence token
(as ``lmforge generate --greedy`` prints them)."""
from __future__ import annotations

import sys

from llama_cpp import Llama


def main() -> None:
    path, prompt = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    llm = Llama(model_path=path, n_ctx=256, n_threads=1, verbose=False, seed=0)
    out = llm(prompt, max_tokens=n, temperature=0.0, top_k=1, repeat_penalty=1.0)
    print(prompt + out["choices"][0]["text"])


if __name__ == "__main__":
    main()
