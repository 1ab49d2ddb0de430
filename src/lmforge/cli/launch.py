"""``lmforge launch slurm``: an sbatch script (and, with --submit, the job)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from lmforge.cli.common import config_and_overrides
from lmforge.config import load_config
from lmforge.models.presets import validate_job
from lmforge.launch import render_slurm_script


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
                   help="GPUs (and training processes) per node")
    s.add_argument("--job-name", default="lmforge", help="SLURM job name")
    s.add_argument("--time", default="24:00:00", dest="time_limit",
                   help="SLURM time limit, HH:MM:SS")
    s.add_argument("--cpus-per-task", type=int, default=32,
                   help="CPUs per node (one task per node, shared by its processes)")
    s.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    s.add_argument("--account", help="SLURM account (default: yours)")
    s.add_argument("--port", type=int, default=29500,
                   help="torchrun rendezvous port on the first node")
    s.add_argument("--output", default="lmforge.sbatch", help="script path to write")
    s.add_argument("--submit", action="store_true", help="run sbatch on the script")
    s.set_defaults(func=_slurm)
    p.set_defaults(func=lambda _: p.print_help() or 2)


def _slurm(args) -> int:
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    config, overrides = config_and_overrides(args.config, args.overrides)
    # Refuse a layout that cannot run on this many processes before writing anything.
    validate_job(load_config(config, overrides), world_size=args.nodes * args.gpus_per_node)
    script = render_slurm_script(config, overrides, args.nodes, args.gpus_per_node,
                                 args.job_name, args.time_limit, args.cpus_per_task,
                                 args.partition, args.account, port=args.port)
    out = Path(args.output)
    Path("slurm-logs").mkdir(exist_ok=True)  # sbatch does not create the --output dir
    out.write_text(script)
    out.chmod(0o755)
    print(f"wrote {out} ({args.nodes} x {args.gpus_per_node} processes)")
    if args.submit:
        if shutil.which("sbatch") is None:
            raise FileNotFoundError("--submit: sbatch is not on PATH (is this a SLURM login node?)")
        subprocess.run(["sbatch", str(out)], check=True)
    return 0
