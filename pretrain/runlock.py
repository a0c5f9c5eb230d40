"""One writer per run directory: a lock file that names its holder, with a heartbeat.

    with hold_run_dir(run_dir, timeout_s=120, log=print):   # rank 0 takes it; every rank learns the outcome
        ...train...

The lock is the file RUN_DIR/.lock, created with os.open(O_CREAT | O_EXCL): exactly one creator
succeeds, on a local disk and on NFS (exclusive create is part of NFSv3 and v4, and Linux clients
have used it since 2.6.5), Lustre and GPFS. flock/fcntl locks are not used: over NFS they depend on
the lock daemon and the mount options (`nolock`, `local_lock`), some cluster filesystems ignore them,
and they vanish with the process without saying who held them. The file holds the holder's identity
as JSON (host, process id, SLURM_JOB_ID, SLURM_ARRAY_TASK_ID, start time, a random token), so a
refusal can name it. While the lock is held a daemon thread touches the file (os.utime, which on NFS
asks the server to stamp its own time) every timeout/4 seconds: the heartbeat costs nothing per
step. The lock file is read with open() + fstat, which revalidates NFS's cached attributes
(close-to-open consistency), so a reader sees the current heartbeat.

Taking a lock over (the holder is gone): its process no longer runs on this host; its heartbeat is
older than the timeout (any host: a holder on another node that died, or a process id reused
after a reboot); or it belongs to this very Slurm job and array task (a requeued job restarting
after its predecessor died, on any node). The stale file is renamed aside (atomic, also on NFS),
the renamed file's token is checked to be the stale one (another process may have taken the lock
over first: then its file is put back), and the lock is created anew; one line says whom it took
over and why.

Otherwise a second trainer is refused at once, in one sentence naming the holder, before it writes
anything in the run directory. A Slurm job whose holder is another job on another node waits
instead (up to the timeout, with a line): a job requeued right after its predecessor died must not
fail because that predecessor's heartbeat is still recent. As soon as the heartbeat moves, the holder
is alive and the job is refused; once it is older than the timeout, it is taken over.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

LOCK_NAME = ".lock"


class RunLockError(ValueError):
    """The run directory is held by another trainer (one sentence naming it)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    slurm_job_id: str
    slurm_array_task_id: str
    started: float  # time.time() at acquisition
    token: str

    @classmethod
    def me(cls, env=None) -> "Holder":
        env = os.environ if env is None else env
        return cls(socket.gethostname(), os.getpid(), env.get("SLURM_JOB_ID", ""),
                   env.get("SLURM_ARRAY_TASK_ID", ""), time.time(), secrets.token_hex(8))

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        task = f" array task {self.slurm_array_task_id}" if self.slurm_job_id and self.slurm_array_task_id else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"process {self.pid} on {self.host}{job}{task}, started {started}"

    def same_job(self, other: "Holder") -> bool:
        return bool(self.slurm_job_id) and (self.slurm_job_id, self.slurm_array_task_id) == \
            (other.slurm_job_id, other.slurm_array_task_id)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (in this PID namespace)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # EPERM: it exists, as someone else's
        return True
    return pid > 0  # 0 would have signalled our own process group


def read_holder(path: str) -> tuple[Holder | None, float]:
    """(the holder named in the lock file or None if unreadable, its last heartbeat: the file's
    mtime). FileNotFoundError when there is no lock."""
    with open(path) as f:  # open() revalidates NFS's attribute cache; fstat then sees the last heartbeat
        mtime = os.fstat(f.fileno()).st_mtime
        text = f.read()
    try:
        d = json.loads(text)
        return Holder(str(d["host"]), int(d["pid"]), str(d.get("slurm_job_id", "")),
                      str(d.get("slurm_array_task_id", "")), float(d["started"]), str(d["token"])), mtime
    except (ValueError, KeyError, TypeError):
        return None, mtime


class RunLock:
    """The lock of one run directory for one process. acquire() takes it or raises RunLockError;
    release() (idempotent) stops the heartbeat and removes the file if it is still ours."""

    def __init__(self, run_dir: str, timeout_s: float, log=print, env=None, poll_s: float | None = None):
        if not timeout_s > 0:
            raise ValueError(f"the run directory lock's timeout must be positive, got {timeout_s}")
        self.run_dir, self.timeout_s, self.log = run_dir, float(timeout_s), log
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.me = Holder.me(env)
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 8)
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking it -------------------------------------------------------------------------------
    def acquire(self) -> "RunLock":
        os.makedirs(self.run_dir, exist_ok=True)
        first_seen = None  # (token, heartbeat) when this Slurm job began to wait
        unreadable_tries = 0
        while True:
            if self._create():
                self.held = True
                self._start_heartbeat()
                return self
            try:
                holder, mtime = read_holder(self.path)
            except FileNotFoundError:  # released (or renamed aside) in between: try again
                continue
            age = time.time() - mtime
            if holder is None:  # being written by its creator right now, or garbage
                if age > self.timeout_s:
                    self._take_over(None, f"its lock file is unreadable and untouched for {age:.0f} s")
                    continue
                unreadable_tries += 1
                if unreadable_tries < 20:
                    time.sleep(0.05)
                    continue
                raise RunLockError(f"{self.run_dir} has an unreadable lock file {self.path} touched {age:.0f} s "
                                   f"ago; if no trainer runs there, delete it and start again")
            reason = self._takeover_reason(holder, age)
            if reason:
                self._take_over(holder, reason)
                continue
            if self._may_wait(holder):
                if first_seen is None or first_seen[0] != holder.token:
                    first_seen = (holder.token, mtime)
                    self.log(f"{self.run_dir} is locked by {holder.describe()} (heartbeat {age:.0f} s ago); this "
                             f"Slurm job waits up to {self.timeout_s:g} s (checkpoint.lock_timeout_s) for the "
                             "heartbeat to stop before taking it over")
                elif mtime != first_seen[1]:  # touched since we first looked: its holder is alive
                    raise RunLockError(self._refusal(holder, age, "its heartbeat is still being refreshed"))
                time.sleep(self.poll_s)
                continue
            raise RunLockError(self._refusal(holder, age))

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self.me), f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _takeover_reason(self, holder: Holder, age: float) -> str:
        if holder.host == self.me.host and not pid_alive(holder.pid):
            return f"process {holder.pid} no longer runs on {holder.host}"
        if age > self.timeout_s:
            return f"its heartbeat is {age:.0f} s old, over checkpoint.lock_timeout_s={self.timeout_s:g}"
        if self.me.same_job(holder) and not (holder.host == self.me.host and holder.pid == self.me.pid):
            if holder.host == self.me.host and pid_alive(holder.pid):
                return ""  # two live trainers inside one job on one node: refused
            return "it is this same Slurm job, requeued"
        return ""

    def _may_wait(self, holder: Holder) -> bool:
        return bool(self.me.slurm_job_id) and holder.host != self.me.host

    def _refusal(self, holder: Holder, age: float, why: str = "") -> str:
        return (f"{self.run_dir} is in use by another trainer: {holder.describe()}, heartbeat {age:.0f} s ago"
                f"{' (' + why + ')' if why else ''}; wait for it to finish, train in another train.run_dir, or, "
                f"if you know that process is dead, delete {self.path}")

    def _take_over(self, holder: Holder | None, reason: str) -> None:
        aside = f"{self.path}.stale-{self.me.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # someone else moved it first
            return
        try:
            moved, _ = read_holder(aside)
        except FileNotFoundError:
            return
        expected = holder.token if holder is not None else None
        if (moved.token if moved is not None else None) != expected:
            # another process took the stale lock over before us and we moved its fresh lock: put it back
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            os.remove(aside)
            return
        os.remove(aside)
        who = holder.describe() if holder is not None else "an unreadable lock"
        self.log(f"taking over the lock of {self.run_dir} from {who}: {reason}")

    # -- holding it ------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="run-dir-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            self.heartbeat()

    def heartbeat(self) -> None:
        try:
            os.utime(self.path)  # times=None: the (NFS server's) current time
            self._warned = False
        except OSError as e:
            if not getattr(self, "_warned", False):  # once, not every beat
                self._warned = True
                self.log(f"warning: cannot refresh the lock {self.path} ({e.strerror}); another trainer may take "
                         "the run directory over")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if self._thread is not None:  # (a beat stuck in os.utime on a hung mount must not hold the exit)
            self._thread.join(timeout=5.0)
            self._thread = None
        try:
            holder, _ = read_holder(self.path)
        except FileNotFoundError:
            return
        if holder is not None and holder.token == self.me.token:
            os.remove(self.path)
        else:
            self.log(f"warning: the lock {self.path} was taken over by "
                     f"{holder.describe() if holder else 'an unreadable lock'} while this trainer held it")

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def refuse_if_held(directory: str, action: str, timeout_s: float = 120.0) -> None:
    """RunLockError when a live trainer holds `directory`'s lock (for a command about to replace it);
    a lock that a trainer would take over (dead or stale holder) does not stop it."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        holder, mtime = read_holder(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    age = time.time() - mtime
    probe = RunLock(directory, timeout_s, log=lambda _: None, env={})
    if holder is None or probe._takeover_reason(holder, age):
        return
    raise RunLockError(f"{directory} is in use by a trainer ({holder.describe()}, heartbeat {age:.0f} s ago); "
                       f"{action} would replace it while it trains: wait for it to finish or choose another folder")


def refuse_before_start(run_dir: str, timeout_s: float, env=None) -> None:
    """The trainer's own refusal (RunLockError), raised early: for a wrapper that writes in the run
    directory before training starts (slurm.job start's records). Silent whenever the trainer would
    take the lock over or, as a Slurm job, wait for it."""
    probe = RunLock(run_dir, timeout_s, log=lambda _: None, env=env)
    try:
        holder, mtime = read_holder(probe.path)
    except (FileNotFoundError, NotADirectoryError):
        return
    age = time.time() - mtime
    if holder is None or probe._takeover_reason(holder, age) or probe._may_wait(holder):
        return
    raise RunLockError(probe._refusal(holder, age))


@contextmanager
def hold_run_dir(run_dir: str, timeout_s: float, log=print, device=None, env=None):
    """Rank 0 holds the run directory's lock for the body; with several ranks, every rank learns
    whether rank 0 got it (one all-reduce), so that all refuse together instead of waiting on rank 0."""
    import torch
    import torch.distributed as dist

    from data_tools.storage import storage_operation

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    lock, error = None, None
    if rank == 0:
        try:
            with storage_operation("taking the run directory's lock", os.path.join(run_dir, LOCK_NAME)):
                lock = RunLock(run_dir, timeout_s, log=log, env=env).acquire()
        except Exception as e:  # noqa: BLE001 - any failure here must reach the other ranks, not strand them
            error = e
    if distributed:
        from parallel.dist import collective

        flag = torch.tensor([0.0 if error is None else 1.0], device=device or "cpu")
        collective("all_reduce(run directory lock)", dist.all_reduce, flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and error is None:
            if lock is not None:
                lock.release()
            error = RunLockError(f"rank 0 could not take the lock of {run_dir} (its error says why)")
    if error is not None:
        raise error
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
