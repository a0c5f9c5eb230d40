"""Atomic, layout-free checkpoints written with torch.distributed.checkpoint (DCP).

`run_dir/checkpoints/step_00000100/` holds DCP files (`.metadata`, `__*.distcp`) for the tensors
{"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", ...}}}, "rng": {"torch_cpu",
"torch_cuda_rank<r>" (rank r's own GPU's; "torch_cuda_<i>" per device before 2026-11-29), "generator.<module>.<attr>"
(a torch.Generator the model owns)}}, `optim.json`
(the optimizer's param_groups, parameters named by FQN) and
`meta.json` (the caller's meta plus schema_version and step). State goes through torch's
get_/set_*_state_dict, so every key is a parameter name and a later load may reshard into another
layout. Only tensors go through DCP (it would unpickle anything else with weights_only=False), so
hyperparameters travel as JSON; DCP's own `.metadata` is the one pickle read.

With no process group DCP runs in this process (`no_dist=True`, passed explicitly; DCP would infer it
and warn). Under data parallelism saving is collective: every rank writes its part of one DCP
checkpoint into the temp directory rank 0 names (with rank 0's pid), then rank 0 alone writes
optim.json and meta.json, renames the directory into place, replaces `latest` and applies retention
while the others wait at a barrier.

Integrity: every file of the checkpoint but meta.json gets an xxh3-128 checksum at save time,
recorded in meta.json ("checksums"); loading verifies them before anything is modified (a flipped
bit is caught, as a truncation is), and `load_latest` falls back to the previous checkpoint when the
newest fails. Under several ranks each rank hashes its own DCP files at save and a share of the files
at load. Checkpoints written before checksums existed load with a line saying so.

Atomicity: everything is written into `.step_X.tmp-<pid>` and fsynced, meta.json last (its presence
marks completeness), then renamed into place; `latest` (the newest directory's name) is replaced via
a fsynced temp file (data_tools.files.atomic_write). Deletion renames aside first, so a crash
mid-delete leaves no complete-looking husk.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from data_tools.errors import first_line
from data_tools.files import atomic_write, file_checksum, fsync_path  # noqa: F401 (file_checksum: re-exported)
from data_tools.files import write_file as _write_file  # a module name, so that a test can make it fail
from data_tools.storage import StorageError, check_space, describe, find_os_error, storage_operation
from parallel.state import LocalState, SavedModel, as_state  # noqa: F401  (checkpoint views, shared with the engines)
from pretrain.checkpoint_integrity import (CHECKSUM, META_FILE, _multi, _rank_checksums, _remaining_checksums,
                                           _verify)
from pretrain.preemption import sigint_deferred
from pretrain.read_pins import pinned, pinning
from pretrain.runlock import pid_alive

SCHEMA_VERSION = 1
OPTIM_FILE, LATEST_FILE, DCP_METADATA = "optim.json", "latest", ".metadata"
_STEP_DIR = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"\.(?:step_\d+|latest)\.(?:tmp|old)-(\d+)")  # temp or set-aside names, with pid


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message is one line naming the checkpoint and the problem."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file does not match the checksum recorded when it was saved (or is missing)."""


class _Unusable(Exception):
    """Why a checkpoint directory is unusable, phrased to follow its name: "is incomplete (...)"."""


def _first_line(e: BaseException) -> str:
    """"TypeName: first line" (data_tools.errors.first_line) of `e`, or of the first rank's error when
    DCP wraps them; a damaged pickle is named without torch's advice to unpickle it anyway."""
    if isinstance(e, CheckpointException) and e.failures:  # DCP wraps per-rank tracebacks
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, pickle.UnpicklingError):  # torch.load's message would suggest weights_only=False
        return "UnpicklingError: damaged data"
    text = first_line(e)
    return f"{type(e).__name__}: {text}" if str(e).strip() else text


@contextlib.contextmanager
def _dcp_call():
    """DCP's keyword for this process; silences its warning that no process group means single process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield {"no_dist": not (dist.is_available() and dist.is_initialized())}


def _read_meta(path: str) -> dict:
    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise _Unusable(f"is incomplete (no {META_FILE})")
    try:
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise _Unusable(f"has an unreadable {META_FILE} ({_first_line(e)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("schema_version"), int):
        raise _Unusable(f"has an unreadable {META_FILE} (not an object with an integer schema_version)")
    return meta


def _read_dcp_metadata(path: str) -> Metadata:
    """DCP's `.metadata`, after checking that every data file it names is there in full."""
    if not os.path.isfile(os.path.join(path, DCP_METADATA)):
        raise _Unusable(f"is incomplete (no DCP {DCP_METADATA} file)")
    try:
        md = dcp.FileSystemReader(path).read_metadata()
        if not isinstance(md, Metadata):
            raise TypeError(f"it holds a {type(md).__name__}")
    except Exception as e:
        raise _Unusable(f"has an unreadable DCP {DCP_METADATA} ({_first_line(e)})") from None
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        if not os.path.isfile(file := os.path.join(path, name)):
            raise _Unusable(f"is incomplete (data file {name} is missing)")
        if os.path.getsize(file) < size:
            raise _Unusable(f"is corrupt (data file {name} is truncated: {os.path.getsize(file)} of {size} bytes)")
    return md


def checkpoint_problem(path: str) -> str | None:
    """None if `path` is a complete checkpoint, else why not, phrased to follow its name ("is
    incomplete (no meta.json)"). Cheap: truncation is seen, bit flips are not (checksums are not read).
    The one test of completeness: every listing, fallback and retention decision asks it."""
    try:
        _read_meta(path)
        _read_dcp_metadata(path)
    except _Unusable as e:
        return str(e)
    return None


def checkpoint_to_read(path: str, log=lambda _: None) -> tuple[str, bool]:
    """(the checkpoint directory `path` names, whether `path` is a run directory), for everything that
    reads a trained model (eval, generate, export, import, checkpoint.init_from): a checkpoint
    directory (complete, or CheckpointError saying why not) or a run's, the one `latest` names or the
    newest complete one when `latest` is unusable (said to `log`; load_latest may still fall back past
    it when it fails its checksums)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    named_like_one = os.path.isfile(os.path.join(path, DCP_METADATA)) or _STEP_DIR.fullmatch(
        os.path.basename(os.path.normpath(path)))
    if os.path.isfile(os.path.join(path, META_FILE)) or named_like_one:
        if (why := checkpoint_problem(path)) is not None:
            raise CheckpointError(f"checkpoint {path} {why}")
        return path, False
    ckpt = latest_checkpoint(path, log=log)
    if ckpt is None:
        if os.path.isfile(os.path.join(path, "config.json")):  # a Hugging Face folder: import it first
            raise ValueError(f"{path} is a Hugging Face folder, not a run, a checkpoint or an exported folder; "
                             f"turn it into a run with `pretrain import {path} runs/NAME`, then use runs/NAME")
        raise ValueError(f"{path} is neither a checkpoint directory nor a run directory with a complete checkpoint")
    return ckpt, True


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, name) of every final-named checkpoint directory, complete or not, ascending."""
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(int(m.group(1)), n) for n in names if (m := _STEP_DIR.fullmatch(n))]
    return sorted(s for s in found if os.path.isdir(os.path.join(root, s[1])))


def _complete_checkpoints(root: str, newest_first: bool = False, older_than: int | None = None):
    """(step, name) of the complete checkpoints in `root` (before step `older_than`), judged lazily."""
    dirs = [(s, n) for s, n in _step_dirs(root) if older_than is None or s < older_than]
    for step, name in reversed(dirs) if newest_first else dirs:
        if checkpoint_problem(os.path.join(root, name)) is None:
            yield step, name


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints of `run_dir`, ascending by step."""
    root = os.path.join(run_dir, "checkpoints")
    return [(s, os.path.join(root, n)) for s, n in _complete_checkpoints(root)]


def _named_by_latest(root: str) -> tuple[str | None, str | None]:
    """(the checkpoint name `latest` holds, or None; None if that checkpoint is usable, else why not)."""
    name = None
    try:
        with open(os.path.join(root, LATEST_FILE)) as f:
            text = f.read(256).strip()
        if not _STEP_DIR.fullmatch(text):
            return None, f"checkpoints/{LATEST_FILE} holds no checkpoint name ({text[:40]!r})"
        name = text
        if not os.path.isdir(os.path.join(root, name)):
            return name, f"checkpoint {name} named by checkpoints/{LATEST_FILE} is missing"
        if (why := checkpoint_problem(os.path.join(root, name))) is not None:
            return name, f"checkpoint {name} {why}"
        return name, None
    except FileNotFoundError:
        return name, f"checkpoints/{LATEST_FILE} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return name, f"checkpoints/{LATEST_FILE} is unreadable ({_first_line(e)})"


def latest_checkpoint(run_dir: str, log=print) -> str | None:
    """The checkpoint `latest` names or, if that is unusable, the newest complete one (said in one line)."""
    root = os.path.join(run_dir, "checkpoints")
    name, reason = _named_by_latest(root)
    if reason is None:
        return os.path.join(root, name)
    fallback = next((n for _, n in _complete_checkpoints(root, newest_first=True) if n != name), None)
    if fallback is not None:
        log(f"{reason}; falling back to {fallback}")
        return os.path.join(root, fallback)
    if name is not None or any(n != name for _, n in _step_dirs(root)):  # a fresh run is not worth a line
        log(f"{reason}; no complete checkpoint to fall back to")
    return None


def _encode(value):  # an optimizer hyperparameter as JSON; tensor values (e.g. a tensor lr) are tagged
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return [_encode(v) for v in value] if isinstance(value, (list, tuple)) else value


def _decode(key: str, value):  # lists other than "params" were tuples (AdamW's betas)
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    return tuple(_decode("", v) for v in value) if isinstance(value, list) and key != "params" else value


def _to_json(obj, what: str) -> str:
    try:
        return json.dumps(obj, indent=1, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


def _model_generators(target) -> dict[str, torch.Generator]:
    """torch.Generator objects the model owns as module attributes, keyed "generator.<module>.<attr>"."""
    model = getattr(target, "model", None)
    if model is None:
        return {}
    return {f"generator.{name + '.' if name else ''}{attr}": value for name, module in model.named_modules()
            for attr, value in vars(module).items() if isinstance(value, torch.Generator)}


def _has_cuda() -> bool:
    return torch.cuda.is_available()  # (apart: a test stands a GPU's generator in on a CPU)


def _rng_state(target=None) -> dict[str, torch.Tensor]:
    """The global RNGs' states and those of the model's own generators."""
    rng = {"torch_cpu": torch.get_rng_state()}
    if _has_cuda():  # the rank's own GPU, under a key of its own: DCP keeps one copy of a key
        # that every rank saves, so per-device keys came back with another rank's view of this rank's GPU
        rng[f"torch_cuda_rank{dist.get_rank() if dist.is_initialized() else 0}"] = torch.cuda.get_rng_state()
    rng.update({k: g.get_state() for k, g in _model_generators(target).items()})
    return rng


def _set_rng_state(rng: dict[str, torch.Tensor], target) -> None:
    torch.set_rng_state(rng["torch_cpu"])
    generators = _model_generators(target)
    for key, value in rng.items():
        if key.startswith("torch_cuda_rank"):
            torch.cuda.set_rng_state(value)  # this rank's GPU (the template asked for this rank's key only)
        elif key.startswith("torch_cuda_"):  # a checkpoint from before the per-rank key: per device index
            torch.cuda.set_rng_state(value, int(key.removeprefix("torch_cuda_")))
        elif key in generators:
            generators[key].set_state(value)


def save_checkpoint(run_dir: str, step: int, model, optimizer, meta: dict, keep_last: int = 2,
                    keep_every: int = 0, checksums: bool = True) -> str:
    """Write checkpoint `step` atomically, point `latest` at it, apply retention; return its path.

    Retention keeps the newest `keep_last` complete checkpoints, those whose step is a multiple of
    `keep_every` (when > 0) and always the one just written; it also removes what crashed saves of
    processes that are gone left behind. `optimizer` may be None (a weights-only checkpoint).
    `checksums=False` records none (saves reading the files back; loads then cannot verify).

    A storage fault (disk full, quota, read-only, permissions; checked for space before anything is
    written) is a StorageError in one sentence on every rank: the partial files are removed and the
    previous checkpoint stays `latest`. Ctrl-C during the save lands after it (the checkpoint is
    completed first).
    """
    meta = _meta_to_save(meta, step, keep_last, keep_every)  # refused before anything is written
    state, groups_text = _state_to_save(as_state(model, optimizer))
    multi = _multi()
    leader = not multi or dist.get_rank() == 0
    pid = _leader_pid(multi)
    root, name = os.path.join(run_dir, "checkpoints"), f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".{name}.tmp-{pid}")
    operation, needed = f"saving checkpoint step {step}", _state_bytes(state) + len(groups_text or "")
    with sigint_deferred(), storage_operation(operation, root, needed):
        _agree(_make_room(root, tmp, operation, needed) if leader else None, multi)
        try:
            with _dcp_call() as kw:  # every rank writes its part; replicated tensors are written once
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), **kw)
            sums = _rank_checksums(tmp, multi) if checksums else None  # collective
            problem = None
            if leader:
                problem = _finish(tmp, final, meta, pid, groups_text, sums, operation,
                                  lambda: _retain(root, step, keep_last, keep_every))
            _agree(problem, multi)  # the others learn whether rank 0 published
        finally:
            if leader:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _agree(problem: tuple[int, str] | None, multi: bool) -> None:
    """Rank 0's storage problem (errno, sentence), raised as a StorageError on every rank."""
    if multi:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise StorageError(*problem)


def _as_problem(e: BaseException, operation: str, path: str, needed: int | None = None):
    """(errno, sentence) of a storage fault, or None for any other error (which the caller re-raises)."""
    if isinstance(e, StorageError):
        return e.errno, str(e)
    found = find_os_error(e)
    return None if found is None else (found.errno, describe(operation, path, found.errno, needed))


def _make_room(root: str, tmp: str, operation: str, needed: int) -> tuple[int, str] | None:
    """The leader's first steps: enough free space for the checkpoint, `root` existing (its entry
    fsynced when new) and `tmp` empty; a storage problem is returned, for every rank to raise."""
    try:
        check_space(operation, root, needed)
        if not os.path.isdir(root):
            os.makedirs(root)
            fsync_path(os.path.dirname(root) or ".")  # the new directory's entry in run_dir
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        problem = _as_problem(e, operation, root, needed)
        if problem is None:
            raise
        return problem
    return None


def _finish(tmp: str, final: str, meta: dict, pid: int, groups_text: str | None, sums: dict | None,
            operation: str, retain) -> tuple[int, str] | None:
    """The leader's last steps: optim.json, the remaining checksums, meta.json, the rename into place,
    `latest`, retention; a storage problem is returned (the previous checkpoint stays `latest`)."""
    try:
        if groups_text is not None:
            _write_file(os.path.join(tmp, OPTIM_FILE), groups_text)
        if sums is not None:
            meta["checksums"] = {"algorithm": CHECKSUM, "files": _remaining_checksums(tmp, sums)}
        _publish(tmp, final, meta, pid)
        atomic_write(os.path.join(os.path.dirname(final), LATEST_FILE), os.path.basename(final) + "\n")
    except OSError as e:
        problem = _as_problem(e, operation, os.path.dirname(final))
        if problem is None:
            raise
        return problem
    retain()
    return None


def _state_bytes(tree) -> int:
    """Bytes of the tensors in a nested dict: what the checkpoint's files will take, about."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_state_bytes(v) for v in tree.values())
    return 0


def _meta_to_save(meta: dict, step: int, keep_last: int, keep_every: int) -> dict:
    """The caller's meta with schema_version and step, after checking the arguments and that it is JSON."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep_last < 1 or keep_every < 0:
        raise ValueError(f"keep_last must be >= 1 and keep_every >= 0, got {keep_last} and {keep_every}")
    for key, value in (("step", step), ("schema_version", SCHEMA_VERSION), ("checksums", None)):
        if key in meta and meta[key] != value:
            raise ValueError(f"meta[{key!r}] is {meta[key]!r} but the checkpoint's {key} is {value!r}")
    meta = {**meta, "schema_version": SCHEMA_VERSION, "step": step}
    _to_json(meta, "meta")
    return meta


def _state_to_save(target) -> tuple[dict, str | None]:
    """(the tensors DCP writes, the optimizer's param_groups as JSON or None); collective under ranks."""
    state: dict = {"rng": _rng_state(target)}
    state["model"], optim_sd = target.get_state()
    for key, value in state["model"].items():  # DCP would pickle it, and loading refuses pickles
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"model state {key} is a {type(value).__name__}, not a tensor: checkpoints hold "
                             "tensors only (register it as a buffer, or derive it from the config)")
    if optim_sd is None:
        return state, None
    if optim_sd["state"]:
        state["optim"] = {"state": optim_sd["state"]}
    groups = [{k: _encode(v) for k, v in g.items()} for g in optim_sd["param_groups"]]
    return state, _to_json({"param_groups": groups}, "the optimizer's param_groups")


def _leader_pid(multi: bool) -> int:
    """Rank 0's pid, which names the temp directory every rank writes into."""
    pid = os.getpid()
    if multi:
        box = [pid]
        dist.broadcast_object_list(box, src=0)
        pid = box[0]
    return pid


def _publish(tmp: str, final: str, meta: dict, pid: int) -> None:
    """The leader's last steps: meta.json (last: its presence marks completeness), everything fsynced,
    `tmp` renamed to `final` (an earlier save of the same step swapped out, then deleted)."""
    _write_file(os.path.join(tmp, META_FILE), _to_json(meta, "meta"))
    for dirpath, _, files in os.walk(tmp):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)
    root, name = os.path.split(final)
    if os.path.lexists(final):  # a re-save of this step after a resume: swap, then delete the old
        aside = os.path.join(root, f".{name}.old-{pid}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(tmp, final)
        fsync_path(root)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
        fsync_path(root)


def _retain(root: str, just_written: int, keep_last: int, keep_every: int) -> None:
    steps = _step_dirs(root)
    complete = [s for s, _ in _complete_checkpoints(root)]
    named, _ = _named_by_latest(root)  # never the one `latest` names (just_written, but said outright)
    read_now, stale_pins = pinned(root)  # nor one a reader is loading (pretrain/read_pins.py)
    keep = {just_written, *complete[-keep_last:], *(s for s in complete if keep_every and s % keep_every == 0),
            *([_step_of(named)] if named else []), *(_step_of(n) for n in read_now)}
    doomed = [n for s, n in steps if s not in keep]
    trash = [os.path.join(root, f".{n}.old-{os.getpid()}") for n in doomed] + stale_pins
    for n, aside in zip(doomed, trash):  # aside first: a crash mid-rmtree must not leave a husk
        os.rename(os.path.join(root, n), aside)
    if doomed:
        fsync_path(root)
    for n in os.listdir(root):  # leftovers of crashed saves by processes that are gone
        if (m := _LEFTOVER.fullmatch(n)) and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            trash.append(os.path.join(root, n))
    for path in trash:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def read_meta(path: str) -> dict:
    """meta.json of checkpoint `path` (JSON only, schema checked); CheckpointError if unusable."""
    try:
        meta = _read_meta(path)
    except _Unusable as e:
        raise CheckpointError(f"checkpoint {path} {e}") from None
    if meta["schema_version"] > SCHEMA_VERSION:
        raise CheckpointError(f"checkpoint {path} has schema_version {meta['schema_version']}, "
                              f"newer than this code's {SCHEMA_VERSION}; update the code to load it")
    return meta


def load_checkpoint(path: str, model, optimizer=None, restore_rng: bool = True,
                    expect_arch: str | None = None, verify: bool = True, log=print) -> dict:
    """Load checkpoint `path` in place into `model` (and `optimizer`, and the RNG); return its meta.

    With `verify`, every file is checked against the checksums recorded at save time first
    (CorruptCheckpoint names the bad file; a checkpoint from before checksums is loaded with a line
    saying so). The model is checked before it is modified, but a failure inside DCP's read itself
    may leave it partly loaded (in place): a CheckpointError is never something to continue past.
    Gradients are dropped when the optimizer is loaded (they belong to the old weights).
    `model` may be a SavedModel, which receives the saved model tensors as they are.
    """
    meta, saved = _open(path)
    if verify:
        _verify_or_say(path, meta, log)
    _check_arch(path, meta, expect_arch)
    target = as_state(model, optimizer)
    state, groups = _state_to_load(path, saved, target, restore_rng)
    try:
        with _dcp_call() as kw:
            dcp.load(state, checkpoint_id=path, **kw)
        target.set_state(state["model"], state["optim"]["state"] if "optim" in state else {}, groups)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} could not be loaded ({_first_line(e)})") from None
    if restore_rng:
        _set_rng_state(state["rng"], target)
    return meta


def _open(path: str) -> tuple[dict, dict]:
    """(meta.json, DCP's entries by key) of checkpoint `path`; CheckpointError if it is unusable."""
    meta = read_meta(path)
    try:
        return meta, _read_dcp_metadata(path).state_dict_metadata
    except _Unusable as e:
        raise CheckpointError(f"checkpoint {path} {e}") from None


def _verify_or_say(path: str, meta: dict, log) -> None:
    """CorruptCheckpoint unless the files match their checksums; a line when none were recorded."""
    if "checksums" not in meta:
        log(f"checkpoint {path} carries no checksums (saved before they were recorded, or with "
            "checkpoint.verify=false): loaded unverified")
    elif (why := _verify(path, meta)) is not None:
        raise CorruptCheckpoint(f"checkpoint {path} {why}")


def _check_arch(path: str, meta: dict, expect_arch: str | None) -> None:
    model_cfg = meta["config"].get("model") if isinstance(meta.get("config"), dict) else None
    arch = model_cfg.get("arch") if isinstance(model_cfg, dict) else None
    if expect_arch is not None and arch != expect_arch:
        raise CheckpointError(f"checkpoint {path} holds model.arch {arch!r}, the config asks for {expect_arch!r}")


def _state_to_load(path: str, saved: dict, target, restore_rng: bool) -> tuple[dict, list | None]:
    """(the templates DCP loads into, the param_groups or None), checked against `saved` first."""
    if isinstance(target, SavedModel):  # no model to shape the tensors: take them as they were saved
        target.template = {k.removeprefix("model."): torch.empty(e.size, dtype=e.properties.dtype)
                           for k, e in saved.items() if k.startswith("model.") and isinstance(e, TensorStorageMetadata)}
    state = {"model": target.model_template()}
    _check(path, saved, state, _held(target, state))  # before the optimizer's lazy state gets created below
    groups = None
    if target.has_optimizer:
        groups = _read_param_groups(path)
        if any(k.startswith("optim.") for k in saved):  # (none if saved before the first step.)
            state["optim"] = {"state": target.optim_template()}
    if restore_rng:
        if "rng.torch_cpu" not in saved:
            raise CheckpointError(f"checkpoint {path} holds no RNG state")
        state["rng"] = {k: v for k, v in _rng_state(target).items() if f"rng.{k}" in saved}  # CUDA only if saved
        if _has_cuda():  # a checkpoint from before the per-rank key: this GPU's per-device one
            legacy = f"torch_cuda_{torch.cuda.current_device()}"
            if f"rng.{legacy}" in saved:
                state["rng"][legacy] = torch.cuda.get_rng_state()
    _check(path, saved, state, _held(target, state))
    return state, groups


def _held(target, state: dict) -> set[str]:
    """The keys every rank's `state` asks for: a pipeline stage's view gathers its stages' (each holds
    part of the model), so that only a key no stage asks for is an extra."""
    mine = {k for k, _ in _flatten(state)}
    return target.keys_of_every_stage(mine) if hasattr(target, "keys_of_every_stage") else mine


def _read_param_groups(path: str) -> list:
    try:
        with open(os.path.join(path, OPTIM_FILE)) as f:
            return [{k: _decode(k, v) for k, v in g.items()} for g in json.load(f)["param_groups"]]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (saved without one)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable {OPTIM_FILE} ({_first_line(e)})") from None


def load_latest(run_dir: str, model, optimizer=None, restore_rng: bool = True, expect_arch: str | None = None,
                verify: bool = True, log=print, start: str | None = None) -> tuple[str, dict] | tuple[None, None]:
    """Load the checkpoint `latest` names (or `start`, one the caller chose from it, e.g. a reader that
    pinned it), falling back to the newest older one when it is unusable (incomplete, truncated, or
    failing its checksums), each fallback said in one line; return (path, meta), or (None, None) when
    the run has no complete checkpoint. When every complete checkpoint fails its checksums this
    raises: starting over would discard them. A reader's fallback (`start` given) is pinned for its
    read as the reader pinned `start` (pretrain/read_pins.py)."""
    path = start or latest_checkpoint(run_dir, log=log)
    if path is None:
        return None, None
    root, first_error = os.path.dirname(path), None
    while True:
        try:
            with pinning(path) if start is not None and path != start else contextlib.nullcontext():
                return path, load_checkpoint(path, model, optimizer, restore_rng, expect_arch, verify, log)
        except CorruptCheckpoint as e:  # raised before anything was modified
            if not os.path.isdir(path):  # pruned under the read, not corrupt: the caller's to handle
                raise CheckpointError(f"checkpoint {path} was removed while being read") from None
            first_error = first_error or e
            older = next(_complete_checkpoints(root, newest_first=True, older_than=_step_of(path)), None)
            why = str(e).removeprefix(f"checkpoint {path} ")
            if older is None:
                raise CorruptCheckpoint(f"{first_error}; no older complete checkpoint to fall back to (set "
                                        "checkpoint.verify=false to load it anyway)") from None
            log(f"checkpoint {os.path.basename(path)} {why}; falling back to {older[1]}")
            path = os.path.join(root, older[1])


def _step_of(path: str) -> int:
    return int(_STEP_DIR.fullmatch(os.path.basename(path)).group(1))


def _check(path: str, saved: dict, state: dict, held: set[str]) -> None:
    """Every tensor `state` asks for is saved with its shape; the model/optim sections have no extras
    (keys that no rank's state, `held`, asks for)."""
    wanted = dict(_flatten(state))
    for key, tensor in wanted.items():
        if not isinstance(entry := saved.get(key), TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path} has no tensor {key} (saved from a different model, or by an "
                                  "older version of this one: `pretrain import` upgrades its weights into a new run)")
        if tuple(entry.size) != tuple(tensor.size()):
            raise CheckpointError(f"checkpoint {path} has {key} of shape {tuple(entry.size)}, "
                                  f"the model has {tuple(tensor.size())} (a different model size?)")
    extra = sorted(k for k in saved if k.startswith(tuple(f"{s}." for s in state if s != "rng")) and k not in held)
    if extra:
        raise CheckpointError(f"checkpoint {path} has {extra[0]} (and {len(extra) - 1} more keys) "
                              "that the model lacks (saved from a different model?)")


def _flatten(tree: dict, prefix: str = ""):
    """(DCP key, tensor) of a nested dict of tensors; DCP joins nested keys with '.'."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
