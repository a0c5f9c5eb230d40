"""A cluster profile: the site-specific half of a Slurm job (partition, account, GPUs, environment).

    profile = load_profile("slurm/profiles/example.yaml")

Required fields name what every cluster must say; the rest have defaults. An unknown or missing
field is a one-line ProfileError naming it.
"""
from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields

from data_tools.errors import first_line

LAUNCHERS = ("torchrun", "srun", "mpi")


class ProfileError(ValueError):
    """A cluster profile that cannot be used, in one sentence."""


@dataclass
class ClusterProfile:
    partition: str
    nodes: int
    gpus_per_node: int  # 0 on CPU clusters: one training process per node then
    cpus_per_task: int
    time: str  # Slurm's time limit: MM, HH:MM:SS or D-HH:MM:SS
    account: str = ""
    qos: str = ""
    launcher: str = "torchrun"  # torchrun: one srun task per node running torchrun; srun: one task per
    # process, no torchrun; mpi: mpirun (or srun --mpi=<mpi_plugin>) with mpi4py rank discovery
    procs_per_node: int = 0  # training processes per node; 0 = gpus_per_node, or 1 without GPUs
    mpi_plugin: str = ""  # e.g. pmix: launch MPI through srun --mpi=pmix instead of mpirun
    python: str = "python"  # the interpreter on the compute nodes (a venv's bin/python)
    setup: list = field(default_factory=list)  # shell lines run first (module load ..., source ...)
    env: dict = field(default_factory=dict)  # variables exported to every process
    signal_lead_s: int = 180  # the warning signal comes this long before the time limit
    max_restarts: int = 3  # consecutive starts that end without progress before the job gives up
    sbatch: list = field(default_factory=list)  # further #SBATCH options, e.g. ["--mem=0", "--exclusive"]

    @property
    def nproc(self) -> int:
        return self.procs_per_node or self.gpus_per_node or 1

    def validate(self) -> None:
        for name in ("nodes", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ProfileError(f"cluster profile field {name!r} must be at least 1, got {getattr(self, name)}")
        for name in ("gpus_per_node", "procs_per_node", "max_restarts"):
            if getattr(self, name) < 0:
                raise ProfileError(f"cluster profile field {name!r} must be >= 0, got {getattr(self, name)}")
        if not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", str(self.time)):
            raise ProfileError(f"cluster profile field 'time' must look like 30, 04:00:00 or 2-00:00:00, got {self.time!r}")
        if self.launcher not in LAUNCHERS:
            raise ProfileError(f"cluster profile field 'launcher' must be one of {', '.join(LAUNCHERS)}, "
                               f"got {self.launcher!r}")
        if self.signal_lead_s < 10:
            raise ProfileError(f"cluster profile field 'signal_lead_s' must be at least 10 s, got {self.signal_lead_s}")
        if not (isinstance(self.setup, list) and isinstance(self.sbatch, list) and isinstance(self.env, dict)):
            raise ProfileError("cluster profile fields 'setup' and 'sbatch' must be lists and 'env' a mapping")


REQUIRED = [f.name for f in fields(ClusterProfile) if f.default is MISSING and f.default_factory is MISSING]


def profile_from_dict(data: dict, source: str = "cluster profile") -> ClusterProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    known = {f.name: f for f in fields(ClusterProfile)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ProfileError(f"{source}: unknown field {unknown[0]!r} (known: {', '.join(known)})")
    missing = [n for n in REQUIRED if n not in data]
    if missing:
        raise ProfileError(f"{source}: missing field {missing[0]!r} (required: {', '.join(REQUIRED)})")
    for name, value in data.items():
        want = known[name].type
        if want == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
            raise ProfileError(f"{source}: field {name!r} must be an integer, got {value!r}")
    profile = ClusterProfile(**{k: (str(v) if known[k].type == "str" else v) for k, v in data.items()})
    try:
        profile.validate()
    except ProfileError as e:
        raise ProfileError(f"{source}: {e}") from None
    return profile


def load_profile(path: str) -> ClusterProfile:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ProfileError(f"cluster profile {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"cluster profile {path} is not valid YAML: {first_line(e)}") from None
    return profile_from_dict(data or {}, f"cluster profile {path}")
