"""A real two-node Slurm on this machine for the `slurm` tests (Debian's slurmctld, slurmd, munge).

Everything lives in one directory with its own ports: munged on a private socket, slurmctld, and one
slurmd per virtual node (n1, n2, both 127.0.0.1). Clients find it through SLURM_CONF. The daemons
are Popen children, stopped (and waited for) by `stop()`. See ../shared/design/SLURM_NOTES.md.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time

from distributed import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")
INSTALL = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
KILL_WAIT_S = 90  # Slurm's SIGTERM-to-SIGKILL delay: above the checkpoint grace time (60 s)
START_TRIES = 3  # a port chosen free can be taken before its daemon binds it: start again on new ports


def missing_binaries() -> list[str]:
    return [b for b in DAEMONS if shutil.which(b) is None]


class SlurmCluster:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.procs: list[subprocess.Popen] = []
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def _conf(self, ctld_port: int, node_ports: tuple[int, int]) -> str:
        d = self.root
        return f"""ClusterName=ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/run/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
InactiveLimit=0
KillWait={KILL_WAIT_S}
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
Waittime=0
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[1]} CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

    def start(self) -> "SlurmCluster":
        for _ in range(START_TRIES):
            self._start_once()
            unbound = self._unbound_daemons()
            if not unbound:
                return self
            self.stop()
        raise RuntimeError(f"Slurm fixture: {', '.join(unbound)} could not bind its port in "
                           f"{START_TRIES} starts (logs in {os.path.join(self.root, 'log')})")

    def _unbound_daemons(self) -> list[str]:
        """Daemons whose log says their listening port was taken. A slurmd in that state still registers
        and shows IDLE, but slurmctld's messages for it reach the other node (seen in CI: "Registered
        JobId=... on wrong node n1", then jobs that never finish)."""
        names = {"slurmctld": "slurmctld.log", "n1": "slurmd-n1.log", "n2": "slurmd-n2.log"}
        bad = []
        for name, file in names.items():
            path = os.path.join(self.root, "log", file)
            if os.path.exists(path) and "Unable to bind listen port" in open(path, errors="replace").read():
                bad.append(name)
        return bad

    def _start_once(self) -> None:
        d = self.root
        for sub in ("log", "state", "spool"):  # a retry starts from nothing
            shutil.rmtree(os.path.join(d, sub), ignore_errors=True)
        for sub in ("munge", "run", "log", "state", "spool/n1", "spool/n2", "jobs"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.chmod(os.path.join(d, "munge"), 0o700)
        os.chmod(os.path.join(d, "run"), 0o755)
        key = os.path.join(d, "munge", "munge.key")
        if os.path.exists(key):
            os.chmod(key, 0o600)
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld, p1, p2 = free_ports(3)
        with open(self.conf, "w") as f:
            f.write(self._conf(ctld, (p1, p2)))

        def spawn(name, argv):
            out = open(os.path.join(d, "log", f"{name}.stdout"), "w")
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env))

        sock = f"{d}/run/munge.sock"
        if os.path.exists(sock):
            os.remove(sock)
        spawn("munged", ["munged", "-F", f"--socket={sock}", f"--key-file={key}",
                         f"--pid-file={d}/run/munged.pid", f"--log-file={d}/log/munged.log",
                         f"--seed-file={d}/munge/munged.seed"])
        self._wait(lambda: os.path.exists(sock), 10, "munged did not create its socket")
        spawn("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        spawn("n1", ["slurmd", "-D", "-N", "n1", "-f", self.conf])
        spawn("n2", ["slurmd", "-D", "-N", "n2", "-f", self.conf])
        self._wait(lambda: self.run("scontrol", "show", "nodes", "-o", check=False).stdout.count("State=IDLE ") == 2,
                   60, "the two slurmd nodes did not become IDLE")

    def _wait(self, cond, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            time.sleep(0.2)
        logs = os.path.join(self.root, "log")
        raise RuntimeError(f"Slurm fixture: {what} within {timeout} s (logs in {logs})")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def run(self, *argv, check=True, **kw) -> subprocess.CompletedProcess:
        res = subprocess.run(list(argv), capture_output=True, text=True, env={**self.env, **kw.pop("env", {})},
                             timeout=kw.pop("timeout", 120), **kw)
        if check and res.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
        return res

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job, "-o", check=False).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job: str, name: str) -> str:
        out = self.run("scontrol", "show", "job", job, "-o", check=False).stdout
        for word in out.split():
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return ""

    def wait_state(self, job: str, states: tuple[str, ...], timeout: float = 300) -> str:
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            state = self.job_state(job)
            if state in states:
                return state
            time.sleep(0.5)
        raise RuntimeError(f"job {job} did not reach {'/'.join(states)} within {timeout} s (last state {state})\n"
                           + self.diagnose(job))

    def diagnose(self, job: str) -> str:
        """What a stuck job leaves to read: its record, the processes still alive, the daemons' last words."""
        record = self.run("scontrol", "show", "job", job, check=False).stdout.strip()
        parts = [record]
        out = next((w.split("=", 1)[1] for w in record.split() if w.startswith("StdOut=")), "")
        if os.path.isfile(out):
            parts.append(f"--- {out}, last lines ---\n" + "".join(open(out, errors="replace").readlines()[-20:]))
        ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,args", "--forest"], capture_output=True, text=True)
        parts.append("\n".join(line[:200] for line in ps.stdout.splitlines()
                               if any(k in line for k in ("python", "torchrun", "slurm", "srun", "bash", "PID"))))
        for node in ("n1", "n2"):
            log = os.path.join(self.root, "log", f"slurmd-{node}.log")
            if os.path.exists(log):
                parts.append(f"--- slurmd {node}, last lines ---\n" + "".join(open(log).readlines()[-15:]))
        log = os.path.join(self.root, "log", "slurmctld.log")
        if os.path.exists(log):
            parts.append("--- slurmctld, last lines ---\n" + "".join(open(log).readlines()[-15:]))
        return "\n".join(parts)

    def array_states(self, job: str) -> list[str]:
        out = self.run("scontrol", "show", "job", job, "-o", check=False).stdout
        return [w.split("=", 1)[1] for line in out.splitlines() for w in line.split() if w.startswith("JobState=")]
