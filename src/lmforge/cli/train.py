"""``lmforge train``."""
from __future__ import annotations

import os
import sys
import time

from lmforge.cli.common import add_config_arguments, config_and_overrides
from lmforge.config import ConfigError, config_yaml, load_config
from lmforge.config.paths import with_absolute_paths
from lmforge.data.build import build_data, check_tokenizer_source
from lmforge.data.tokenizer import load_tokenizer
from lmforge.job import resolve
from lmforge.models.registry import build_model
from lmforge.parallel.mesh import DistEnv, read_dist_env
from lmforge.peft.lora import prepare_model_for_lora, trainable_summary
from lmforge.perf.auto_batch import size_micro_batch
from lmforge.perf.budget import check_memory, refusal
from lmforge.perf.estimate import estimate_memory, format_table
from lmforge.perf.estimate_setup import Setup
from lmforge.train.loop import check_job, train
from lmforge.train.preempt import PREEMPTED_EXIT_CODE


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (no config: the embedded CPU demo)",
                       description="Train a model. Without CONFIG, runs the embedded demo: a "
                       "tiny Llama trained on the CPU on the Python standard library.")
    add_config_arguments(p, list_keys=True)
    look = p.add_mutually_exclusive_group()
    look.add_argument("--print-config", action="store_true",
                      help="check the config as the run would and print it resolved (as "
                      "the run saves it in config.yaml), then exit")
    look.add_argument("--dry-run", action="store_true",
                      help="check the config as the run would, build the model on the meta "
                      "device, print its parameter counts, the memory estimate and (SFT, "
                      "preference) the samples' counts and cuts, and exit (nothing is "
                      "trained; the run directory is not touched)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="with --dry-run or --print-config: the processes the run will have "
                   "(the layout is resolved for them; default: this "
                   "one's, 1 outside torchrun)")
    p.set_defaults(func=_train)


# How long a rank other than 0 that refused the config waits before exiting: rank 0,
# refusing it alike, says why and exits first, so the launcher stops the others (torchrun
# would otherwise kill rank 0 before it prints, when another rank exits first).
QUIET_RANK_EXIT_DELAY_S = 10.0


def _train(args) -> int:
    if args.print_config or args.dry_run or args.world_size is not None:
        return _look_before_running(args)
    env = read_dist_env()
    try:
        summary = train(load_config(*config_and_overrides(args.config, args.overrides)))
    except ConfigError:
        if env.rank != 0:  # every rank refuses a config alike: rank 0 alone says why
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
            return 2
        raise
    # Stopped by SIGUSR1/SIGTERM/SIGINT with a checkpoint written: unfinished, resumable.
    code = PREEMPTED_EXIT_CODE if "preempted_at" in summary else 0
    if env.torchrun:
        _leave_without_teardown(code)
    return code


def _look_before_running(args) -> int:
    """``--print-config`` and ``--dry-run``: the run's config and shape, no run."""
    looking = args.dry_run or args.print_config
    if args.world_size is not None and not (looking and args.world_size >= 1):
        raise ValueError("--world-size: only with --dry-run or --print-config, and >= 1")
    cfg = load_config(*config_and_overrides(args.config, args.overrides))
    env = read_dist_env() if args.world_size is None else DistEnv(0, args.world_size, 0)
    if args.print_config:  # as the run resolves it: a config it would refuse is refused
        sized, _ = size_micro_batch(cfg, env.world_size)  # (auto: the number it would be)
        # (with its paths absolute, as the run saves it)
        print(config_yaml(resolve(with_absolute_paths(sized), env.world_size).config), end="")
        return 0
    job = check_job(cfg, env)
    model = build_model(job.args)  # meta device: nothing allocated
    if cfg.lora.enabled:
        prepare_model_for_lora(model, cfg.lora)
    estimate = estimate_memory(Setup(job))
    memory = check_memory(job, env.local_rank, estimate.total_bytes)
    if env.rank == 0:
        print(f"parameters: {trainable_summary(model)}")
        print(format_table(estimate))
        print(memory.describe(), flush=True)
        _describe_samples(job.config, env)
    if not memory.fits:  # refused as the run would be: exit 2, one line
        raise ConfigError(refusal(job, memory))
    if env.rank == 0:
        print("dry run: the config is valid; nothing was trained, the run directory "
              "was not touched")
    return 0


def _describe_samples(cfg, env: DistEnv) -> None:
    """SFT samples and preference pairs: what the run will train on (counts, cuts and
    skips), read as the run reads them (the data cache is filled, the run directory is
    not touched)."""
    if cfg.data.kind not in ("sft", "preference"):
        return
    check_tokenizer_source(cfg)  # (as the run refuses it)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.init_from)
    data = build_data(cfg, tokenizer, 0, env.world_size)
    print(f"data: {data.description}; held out: {data.eval_note}")
    for note in data.notes:
        print(note)


def _leave_without_teardown(code: int) -> None:
    """A torchrun worker whose run finished (checkpoint committed, export written, process
    groups destroyed) exits here, skipping interpreter teardown: there, a gloo transport
    thread still alive can make the C++ runtime abort ("terminate called without an active
    exception"), and torchrun would then report a successful run as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
