"""A 2-rank start through `mpirun -np 2` reaches the same process groups as torchrun: ranks from
Open MPI's environment, rank 0's address through mpi4py, gloo collectives, and a TP2 run whose
losses equal one process's."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from trainer_helpers import step_losses, train_run, write_markov_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mpirun_two_ranks_train_like_torchrun(tmp_path):
    # The test command installs these (scripts/test.sh); a missing one is a failure that names it.
    if shutil.which("mpirun") is None:
        pytest.fail("Open MPI's mpirun is not installed: apt-get install openmpi-bin libopenmpi-dev")
    for module, what in (("mpi4py", "MPI rank discovery"), ("megatron.core", "the TP2 run")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.fail(f"{what} needs {module}, which is not installed: bash scripts/setup_env.sh")
    corpus = write_markov_corpus(tmp_path / "markov")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONPATH=f"{ROOT}:{ROOT}/tests", OMP_NUM_THREADS="1")
    out = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
                          os.path.join(ROOT, "tests", "mpi_probe.py"), str(tmp_path), corpus],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = sorted(_json_objects(out.stdout),
                   key=lambda r: r["rank"])
    assert [(r["source"], r["rank"], r["world"], r["tp_rank"], r["dp"]) for r in ranks] == \
        [("mpi", 0, 2, 0, 1), ("mpi", 1, 2, 1, 1)]
    train_run(str(tmp_path), corpus, "single", 3, ["train.compile=false"])
    single = step_losses(tmp_path / "single")
    for r in ranks:
        assert {int(k): v for k, v in r["losses"].items()} == pytest.approx(single, rel=1e-5)


def _json_objects(text: str) -> list:
    """Every JSON object printed, even when mpirun interleaves the two ranks' lines on one line."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:  # a brace in other output
            i = text.find("{", i + 1)
            continue
        found.append(obj)
        i = text.find("{", end)
    return found

