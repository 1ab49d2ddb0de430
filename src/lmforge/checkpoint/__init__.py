"""Distributed checkpoints of a training run: ``ROOT/step-NNNNNNN/`` directories that are
written atomically and load on any parallel layout.

- ``directory``: names, the ``COMPLETE`` marker, discovery, the atomic commit, retention;
- ``state``: what is saved and loaded through torch.distributed.checkpoint (model,
  optimizer, RNG, side files), and reading a checkpoint offline;
- ``async_writer``: saves that run in the background while training goes on;
- ``safe_load``: reading ``.metadata`` and non-tensor entries without running code;
- ``integrity``: ``checksums.json``, written by every save and verified at resume;
- ``collective``: ``CheckpointError`` and how the ranks agree on a failure.

Exporting a checkpoint to Hugging Face / PEFT formats lives in ``lmforge.export``.
"""
from lmforge.checkpoint.async_writer import AsyncCheckpointer
from lmforge.checkpoint.collective import CheckpointError
from lmforge.checkpoint.integrity import MANIFEST_NAME, verify_checkpoint
from lmforge.checkpoint.directory import (CONFIG_NAME, EXTRA_NAME, MARKER, META_NAME,
                                       checkpoint_dir, checkpoint_step, clean_stale_tmp,
                                       find_checkpoint, is_complete, latest_checkpoint,
                                       list_checkpoints, prune_checkpoints, resolve_resume,
                                       resume_is_auto)
from lmforge.checkpoint.state import (capture_rng, load_checkpoint, model_tensor_metadata,
                                      read_job_config, read_meta, read_model_state,
                                      restore_rng, save_checkpoint)

__all__ = [
    "AsyncCheckpointer", "CheckpointError", "CONFIG_NAME", "EXTRA_NAME", "MANIFEST_NAME",
    "MARKER", "META_NAME", "capture_rng", "checkpoint_dir", "checkpoint_step", "clean_stale_tmp",
    "find_checkpoint", "is_complete", "latest_checkpoint", "list_checkpoints",
    "load_checkpoint", "model_tensor_metadata", "prune_checkpoints", "read_job_config", "read_meta",
    "read_model_state", "restore_rng", "resolve_resume", "resume_is_auto", "save_checkpoint",
    "verify_checkpoint",
]
