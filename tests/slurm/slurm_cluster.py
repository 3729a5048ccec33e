"""A throwaway Slurm cluster on localhost: one munged, one slurmctld, two slurmd (two nodes).

Everything lives in one temporary folder (``root``):
    key/      munge key and seed (mode 0700, munged insists)
    run/      munge socket and daemon pid files (world-executable: munged insists)
    state/    slurmctld state and each slurmd's spool
    log/      daemon logs, printed by ``log_tails()`` when a test fails
    jobs/     each submission's output file (``--output``)
    slurm.conf

Both emulated nodes run on this host (Debian builds slurmd with multiple-slurmd support), each
with its own port, both reached at 127.0.0.1. The first node is named after this host and the
second sorts after it (HOST, HOST-b), so the allocation's first node, which the sbatch scripts
take as the rendezvous host, resolves like a real node name. A second partition, "urgent",
preempts the default one (PreemptMode=REQUEUE), to test preemption for real.

Daemons run in the foreground as children of this process (and get SIGTERM if it dies), and
``stop()`` ends them by PID. Job processes (slurmstepd, srun, torchrun, workers) are not our
children; they are found by the SLURM_CONF path in their environment, which is unique to this
cluster, and ended by PID too. The system munged and any system Slurm are left alone.
"""

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CPUS_PER_NODE = 2
# Daemons and their helper (slurmctld forks slurmscriptd): stopped in order, not killed as strays.
DAEMON_NAMES = ("munged", "slurmctld", "slurmscriptd", "slurmd")
BINARIES = "munged slurmctld slurmd sbatch squeue scontrol scancel sinfo srun".split()
INSTALL_HINT = (
    "apt-get update && apt-get install -y --no-install-recommends "
    "slurmctld slurmd slurm-client munge"
)


def missing_binaries() -> list[str]:
    """Names of the Slurm and munge programs that are not on PATH (or in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [name for name in BINARIES if shutil.which(name, path=path) is None]


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path, user: str, ctld_port: int, node_ports: dict[str, int]) -> str:
    host = _short_hostname()
    lines = [
        "ClusterName=mpcoretest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also delays a requeued job's restart (default 120 s).
        f"AuthInfo=socket={root}/run/munge.sock,cred_expire=5",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/state/slurmd-%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # The emulated nodes claim what the config says, whatever the host has.
        "SlurmdParameters=config_overrides",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "ReturnToService=2",
        # Finished jobs leave the controller after 4 s; sbatch --wait then polls every 2 s.
        "MinJobAge=4",
        # Seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or preempted:
        # the grace time in which training writes its checkpoint.
        "KillWait=30",
        # Schedule every 2 s, so a requeued job starts as soon as its delay ends.
        "SchedulerParameters=sched_interval=2",
    ]
    for name, port in node_ports.items():
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={CPUS_PER_NODE} RealMemory=4000"
        )
    # A job in "urgent" preempts jobs in "debug": they get SIGTERM, KillWait seconds to stop,
    # and go back to the queue (PreemptMode=REQUEUE, GraceTime 0).
    lines += [
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
        "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
    ]
    return "\n".join(lines) + "\n"


def _die_with_parent() -> None:
    """In a daemon's child before exec: SIGTERM when this (test) process dies, even by SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalCluster:
    """Start with ``start()``, always end with ``stop()`` (also after a failed start)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="mpcore-slurm-"))
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.user = ""
        self.nodes = (_short_hostname(), _short_hostname() + "-b")
        self._daemons: list[tuple[str, subprocess.Popen]] = []

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment pointed at the cluster, without any outer job's SLURM_*."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def start(self, timeout: float = 60.0) -> None:
        for sub, mode in (
            ("key", 0o700),
            ("run", 0o755),
            ("state", 0o755),
            ("log", 0o755),
            ("jobs", 0o755),
        ):
            (self.root / sub).mkdir(mode=mode)
        key = self.root / "key" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
        ports = {name: _free_port() for name in self.nodes}
        self.conf.write_text(_slurm_conf(self.root, self.user, _free_port(), ports))

        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={self.root}/run/munge.sock",
                f"--key-file={key}",
                f"--pid-file={self.root}/run/munged.pid",
                f"--log-file={self.root}/log/munged.log",
                f"--seed-file={self.root}/key/munged.seed",
            ],
        )
        self._wait_for(lambda: (self.root / "run" / "munge.sock").exists(), 10, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name])
        self._wait_for(self._all_idle, timeout, f"{len(self.nodes)} idle nodes")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")  # noqa: SIM115 - kept by the child
        proc = subprocess.Popen(
            argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        log.close()
        self._daemons.append((name, proc))

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.log_tails()}")
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"no {what} after {timeout:.0f} s\n{self.log_tails()}")

    def _all_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-t", "idle", "-o", "%D", check=False).stdout.strip()
        return out == str(len(self.nodes))

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0, **kwargs):
        """Run a Slurm client command against this cluster; returns the CompletedProcess."""
        return subprocess.run(
            argv,
            env=kwargs.pop("env", self.env()),
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            **kwargs,
        )

    def submit(
        self,
        script: Path,
        args: list[str],
        name: str,
        options: list[str],
        env: dict[str, str],
        cwd: Path,
    ) -> "Submission":
        """``sbatch --wait`` of ``script`` in the background; ``name`` must be unique."""
        output = self.root / "jobs" / f"{name}.out"
        argv = [
            "sbatch",
            "--wait",
            f"--job-name={name}",
            f"--output={output}",
            *options,
            str(script),
            *args,
        ]
        proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        return Submission(self, proc, name, output)

    def queue_empty(self) -> bool:
        return self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip() == ""

    def wait_queue_empty(self, timeout: float = 60.0) -> None:
        self._wait_for(self.queue_empty, timeout, "empty queue")

    def log_tails(self, num_lines: int = 25) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-num_lines:]
            parts.append(f"==> {path.name} <==\n" + "\n".join(lines))
        return "\n".join(parts)

    def _stray_pids(self) -> list[int]:
        """PIDs of processes started for this cluster (their environment names our slurm.conf)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        """End job processes, then the daemons, by PID; delete the folder. Safe to call twice."""
        self._kill_strays(keep=DAEMON_NAMES)  # jobs first: a daemon may wait on their steps
        for _name, proc in reversed(self._daemons):  # slurmds, slurmctld, munged last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill_strays(keep=())
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_strays(self, keep: tuple[str, ...]) -> None:
        """SIGKILL this cluster's processes but those whose command name is in ``keep``."""
        for pid in self._stray_pids():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                if name not in keep:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


class Submission:
    """One ``sbatch --wait`` process and the job it submitted (found by its unique name)."""

    def __init__(self, cluster: LocalCluster, proc: subprocess.Popen, name: str, output: Path):
        self.cluster, self.proc, self.name, self.output_path = cluster, proc, name, output
        self._job_id: str | None = None

    def job_id(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while self._job_id is None:
            out = self.cluster.run("squeue", "-h", "-n", self.name, "-o", "%i", check=False)
            if out.stdout.strip():
                self._job_id = out.stdout.split()[0]
            elif time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(
                    f"job {self.name} never appeared in the queue\n{self.report()}"
                )
            else:
                time.sleep(0.2)
        return self._job_id

    def output(self) -> str:
        """The job's output file (stdout and stderr of every run of it)."""
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def report(self, num_chars: int = 6000) -> str:
        sbatch = self.proc.stdout.read() if self.proc.poll() is not None else "(running)"
        return (
            f"--- sbatch: {sbatch}\n--- job output (tail):\n{self.output()[-num_chars:]}\n"
            f"--- daemon logs:\n{self.cluster.log_tails()}"
        )

    def wait(self, timeout: float) -> int:
        """sbatch's exit code (the job's); on timeout cancel the job and fail with the logs."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cluster.run("scancel", "-n", self.name, check=False)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"job {self.name} still running after {timeout:.0f} s\n{self.report()}"
            ) from None
