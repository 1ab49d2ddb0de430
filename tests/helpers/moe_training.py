"""The MoE families' share of ``family_training``: the same worker, steps and data, with
tiny Qwen3-MoE (a dense layer among the sparse ones), Mixtral (a window of 8 keys under
24 tokens), gpt-oss (sinks, a sliding and a global layer, biased experts) and DeepSeek-V3
(latent attention, group-limited routing, shared experts, a dense first layer), in the
layouts an MoE model takes today: FSDP2, LoRA (attention and experts) under it, and tp=2
(the attention split, the experts whole on each rank) with and without sequence
parallelism, and expert parallelism over the FSDP ranks (ep = dp_shard = 2), each against
one process. Every step adds the load-balancing loss (``train.balance``).

``torchrun --nproc-per-node=2 moe_training.py OUT`` writes OUT/results-2.json as
``family_training`` does."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

if __name__ == "__main__":  # (run as a script by torchrun: the tests' folder importable)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import family_training as ft  # noqa: E402
from lmforge.models.registry import PRESETS  # noqa: E402

_SHAPE = dict(vocab_size=97, max_seq_len=64)
FAMILIES = {
    "qwen3_moe": dataclasses.replace(PRESETS["qwen3-moe-debug"], **_SHAPE,
                                     router_aux_loss_coef=0.1),
    "mixtral": dataclasses.replace(PRESETS["mixtral-debug"], **_SHAPE, sliding_window=8,
                                   router_aux_loss_coef=0.1),
    "gpt_oss": dataclasses.replace(PRESETS["gpt-oss-debug"], **_SHAPE),
    "deepseek_v3": dataclasses.replace(PRESETS["deepseek-v3-debug"], **_SHAPE),
}
LAYOUTS = {name: ft.LAYOUTS[name] for name in ("fsdp_dp2", "lora_fsdp_dp2", "tp2_sp")}
LAYOUTS["tp2"] = (2, {"parallel.tp": 2})
# expert parallel over the FSDP ranks: each holds half of every MoE layer's experts
LAYOUTS["ep2_dp2"] = (2, {"parallel.dp_shard": 2, "parallel.ep": 2})


def use_moe_families() -> None:
    """Point the shared worker at the MoE families and their layouts."""
    ft.FAMILIES, ft.LAYOUTS = FAMILIES, LAYOUTS
    ft.REFERENCE_OF = {**ft.REFERENCE_OF, "tp2": "single", "ep2_dp2": "single"}


if __name__ == "__main__":
    use_moe_families()
    ft.main(Path(sys.argv[1]))
