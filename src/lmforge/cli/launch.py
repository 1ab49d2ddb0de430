"""``lmforge launch slurm``: an sbatch script (and, with --submit, the job)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from lmforge import fsio
from lmforge.checkpoint import resume_is_auto
from lmforge.cli.common import config_and_overrides
from lmforge.config import load_config
from lmforge.job import resolve
from lmforge.launch import processes_per_node, render_slurm_script
from lmforge.perf.auto_batch import checked_as_number

LOG_DIR = "slurm-logs"  # the jobs' logs, relative to the directory sbatch is run from


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="write (and submit) a cluster launch script",
                       description="Write a launch script for a cluster scheduler.")
    lsub = p.add_subparsers(metavar="SCHEDULER")
    s = lsub.add_parser("slurm", help="an sbatch script using srun + torchrun rendezvous",
                        description="Write an sbatch script that runs `lmforge train` on "
                        "NODES x GPUS processes (srun starts one torchrun per node).")
    s.add_argument("config", nargs="?", help="YAML recipe")
    s.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, passed on to lmforge train")
    s.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    s.add_argument("--gpus-per-node", type=int, required=True,
                   help="GPUs (and training processes) per node; 0: a CPU job (gloo)")
    s.add_argument("--procs-per-node", type=int,
                   help="training processes per node (default: one per GPU; required "
                   "with --gpus-per-node 0)")
    s.add_argument("--job-name", default="lmforge", help="SLURM job name")
    s.add_argument("--time", default="24:00:00", dest="time_limit",
                   help="SLURM time limit, HH:MM:SS")
    s.add_argument("--cpus-per-task", type=int, default=32,
                   help="CPUs per node (one task per node, shared by its processes)")
    s.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    s.add_argument("--account", help="SLURM account (default: yours)")
    s.add_argument("--port", type=int, default=29500,
                   help="torchrun rendezvous port on the first node")
    s.add_argument("--stop-before", type=int, default=180, metavar="SECONDS",
                   help="warn the job this long before --time (SLURM --signal): lmforge "
                   "checkpoints after its current step and the job requeues; must cover "
                   "a step and a checkpoint write (default: 180)")
    s.add_argument("--env", metavar="VENV",
                   help="virtual environment to activate on every node (default: the one "
                   "running this command, if any; 'none': use the submitting shell's PATH)")
    s.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line to run before training, e.g. 'module load cuda' "
                   "(repeatable; one line each, run as given by the batch shell; one "
                   "that fails stops the job before it trains)")
    s.add_argument("--output", default="lmforge.sbatch", help="script path to write")
    s.add_argument("--submit", action="store_true", help="run sbatch on the script")
    s.set_defaults(func=_slurm)
    p.set_defaults(func=lambda _: p.print_help() or 2)


def _slurm(args) -> int:
    if args.submit and shutil.which("sbatch") is None:
        raise FileNotFoundError("--submit: sbatch is not on PATH (is this a SLURM login node?)")
    out, log_dir = Path(args.output), Path(LOG_DIR)
    fsio.check_apart(out, "--output", [("CONFIG", args.config), ("--env", args.env)])
    fsio.check_writable(out, "--output")
    fsio.check_writable(log_dir, f"the log directory {LOG_DIR}", kind="dir")
    config, overrides = config_and_overrides(args.config, args.overrides)
    env = _environment(args.env)
    # Every option's value is checked as the script is rendered, before the config is read.
    script = render_slurm_script(config, overrides, args.nodes, args.gpus_per_node,
                                 args.job_name, args.time_limit, args.cpus_per_task,
                                 args.partition, args.account, log_dir=LOG_DIR,
                                 port=args.port, stop_before=args.stop_before, env=env,
                                 setup=tuple(args.setup), procs_per_node=args.procs_per_node)
    cfg = load_config(config, overrides)
    if cfg.train.resume and not resume_is_auto(cfg.train.resume):
        raise ValueError(f"train.resume: {cfg.train.resume}: a SLURM job resumes with "
                         "train.resume=auto (every requeued attempt continues from the "
                         "newest checkpoint in train.output_dir); copy that checkpoint "
                         "into <train.output_dir>/checkpoints/ instead")
    # Refuse a layout that cannot run on this many processes before writing anything.
    procs = processes_per_node(args.gpus_per_node, args.procs_per_node)
    resolve(checked_as_number(cfg), args.nodes * procs,  # (auto: sized on the nodes)
            device="cuda" if args.gpus_per_node else "cpu")
    log_dir.mkdir(exist_ok=True)  # sbatch does not create the directory of #SBATCH --output
    out.write_text(script)
    out.chmod(0o755)
    print(f"wrote {out} ({args.nodes} x {procs} processes; environment: "
          f"{env or 'the submitting shell'}; requeued at the time limit and on preemption, "
          f"resuming with train.resume=auto)")
    if args.submit:
        subprocess.run(["sbatch", str(out)], check=True)
    return 0


def _environment(env: Optional[str]) -> Optional[str]:
    """The virtual environment the job activates, as an absolute path (the job may be
    submitted from another directory); by default the one running ``lmforge launch``."""
    if env is None:
        in_venv = sys.prefix != sys.base_prefix
        return sys.prefix if in_venv else None
    if env == "none":
        return None
    path = Path(env).resolve()
    if not (path / "bin" / "activate").is_file():
        raise FileNotFoundError(f"--env: {path / 'bin' / 'activate'} not found "
                                "(not a virtual environment)")
    return str(path)
