"""The held-out accuracy of a model (optionally with a LoRA adapter) on the example's
prompts: one greedy answer per prompt, scored by the example's reward; prints and writes
{"accuracy", "prompts"} as JSON."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rewards import true_colour  # noqa: E402

from lmforge.data.prompts import PromptDataset  # noqa: E402
from lmforge.data.tokenizer import load_tokenizer  # noqa: E402
from lmforge.models.generate import generate  # noqa: E402
from lmforge.models.hf import load_hf_model  # noqa: E402
from lmforge.peft.adapters import load_adapter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--adapter")
    p.add_argument("--data", required=True)
    p.add_argument("--output", required=True)
    args = p.parse_args()
    tok = load_tokenizer(args.model)
    model = load_hf_model(args.model).eval()
    if args.adapter:
        load_adapter(model, args.adapter)
    data = PromptDataset(args.data, tok, "plain", 64)
    rows = generate(model, data.ids, 12, stop_ids=data.stop_ids)
    texts = [tok.decode(r.ids) for r in rows]
    rewards = true_colour(None, texts, [r["colour"] for r in data.records])
    result = {"accuracy": sum(rewards) / len(rewards), "prompts": len(rewards)}
    Path(args.output).write_text(json.dumps(result) + "\n")
    question = data.records[0]["prompt"][0]["content"]
    print(f"held-out accuracy {result['accuracy']:.3f} on {result['prompts']} prompts "
          f"({args.adapter or args.model}); e.g. {question!r} -> {texts[0]!r}")


if __name__ == "__main__":
    main()
