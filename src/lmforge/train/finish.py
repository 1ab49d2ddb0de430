"""The end of a run: export (HF, and the adapter with LoRA) from the trained weights,
a short sample, the summary block and ``summary.json``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from lmforge import fsio
from lmforge.config import JobConfig
from lmforge.data.build import DataBundle
from lmforge.data.tokenizer import Tokenizer
from lmforge.export import export_trained, trained_model
from lmforge.train.model_setup import TrainModel, gather_full_state_dict
from lmforge.train.progress import Progress, summary_lines
from lmforge.train.sample import write_sample
from lmforge.train.setup import Runtime, say


def finish(cfg: JobConfig, rt: Runtime, model: TrainModel, tokenizer: Tokenizer,
           data: DataBundle, out_dir: Path, history: list[dict],
           progress: Optional[Progress] = None) -> dict:
    """Export and sample (``train.save``), then the summary block and ``summary.json``.
    The held-out loss is the last step's evaluation (``run_loop``)."""
    progress = progress or Progress(cfg, rt.is_logging_rank, started=rt.started)
    sample = (export_and_sample(cfg, rt, model, tokenizer, data, out_dir) if cfg.train.save
              else None)
    # the wall time includes export
    summary = {**progress.summary(out_dir, history, rt.device, data), **data.stats}
    if sample is not None:
        summary["sample"] = sample
    if rt.is_logging_rank:
        fsio.atomic_write_bytes(out_dir / "summary.json", json.dumps(
            {k: v for k, v in summary.items() if k != "sample"}, indent=2).encode())
        print("\n".join(summary_lines(summary)), flush=True)
    return summary


def export_and_sample(cfg: JobConfig, rt: Runtime, model: TrainModel, tokenizer: Tokenizer,
                      data: DataBundle, out_dir: Path) -> Optional[str]:
    """``hf/`` (and ``adapter/``) from the trained weights, then a short sample; returns
    the sample on the logging rank. Collective (the weights are gathered to rank 0)."""
    if model.mesh is not None:
        say(rt, "export: gathering the full weights on rank 0")
    full_sd = gather_full_state_dict(model)
    if not rt.is_logging_rank:
        return None
    # A single-device model holding the trained weights, for export and sampling.
    trained = model.parts[0] if model.mesh is None else trained_model(
        model.args, full_sd, cfg.lora)
    say(rt, f"export: writing {out_dir / 'hf'}"
             + (f" and {out_dir / 'adapter'}" if cfg.lora.enabled else ""))
    export_trained(cfg, trained, tokenizer, out_dir)
    print(f"\nHugging Face export: {out_dir / 'hf'}")
    return write_sample(cfg, trained, tokenizer, data, rt.autocast)
