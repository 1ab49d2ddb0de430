"""A one-host SLURM cluster for the cluster tests: munged, slurmctld and slurmd on this
machine (CPU only, one node with its CPUs), from the OS packages (slurm-wlm, munge),
installed with apt-get when missing. Everything the daemons write (key, socket, state,
spool, logs) is in a temporary directory; ``SLURM_CONF`` points the commands at it."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers.runs import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")


def ensure_installed() -> None:
    """The daemons, installed from the OS packages if need be; a skip saying why not."""
    if all(shutil.which(d) for d in DAEMONS):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"SLURM is not installed and cannot be here (needs root and apt-get "
                    f"for {' '.join(PACKAGES)})")
    proc = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], capture_output=True,
                          text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                          timeout=900)
    if proc.returncode != 0 or not all(shutil.which(d) for d in DAEMONS):
        pytest.skip(f"apt-get install {' '.join(PACKAGES)} failed: "
                    f"{(proc.stderr or proc.stdout)[-300:]}")



CONF = """ClusterName=lmforge-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmctldPidFile={root}/state/slurmctld.pid
SlurmdPidFile={root}/state/slurmd.pid
SlurmdSpoolDir={root}/spool
StateSaveLocation={root}/state
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=3600
KillWait=60
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf = root / "slurm.conf"
        self.conf.write_text(CONF.format(host=socket.gethostname().split(".")[0], root=root,
                                         ctld_port=free_port(), d_port=free_port(),
                                         cpus=os.cpu_count()))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        m = self.root / "munge"
        subprocess.run(["munged", "--force", f"--socket={m / 'socket'}",
                        f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                        f"--log-file={self.root / 'log' / 'munged.log'}",
                        f"--seed-file={m / 'seed'}"], check=True)
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env=self.env)
        subprocess.run(["slurmd", "-f", str(self.conf)], check=True, env=self.env)
        deadline = time.time() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%t"):
            assert time.time() < deadline, (self.root / "log" / "slurmctld.log").read_text()
            time.sleep(0.5)

    def run(self, *cmd: str, check: bool = True) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env,
                              check=check).stdout

    def job(self, job_id: str) -> dict:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, Reason, ...)."""
        fields = {}
        for word in self.run("scontrol", "show", "job", job_id).split():
            key, sep, value = word.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float = 600,
                 restarts: int = 0) -> dict:
        """The job's fields once it is in one of ``states`` after at least ``restarts``
        requeues (a job is PENDING before its first run too)."""
        deadline = time.time() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states and \
                    int(fields.get("Restarts", 0)) >= restarts:
                return fields
            assert time.time() < deadline, f"job {job_id}: {fields}"
            time.sleep(1)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user", "root", check=False)
        for pid_file in (self.root / "state" / "slurmd.pid",
                         self.root / "state" / "slurmctld.pid",
                         self.root / "munge" / "munged.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
