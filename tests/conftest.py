import glob
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the project's own `kernels`/`parallel`, never same-named PyPI packages
    sys.path.insert(0, ROOT)

# Without a GPU, Triton kernels run only in Triton's interpreter, and Triton reads TRITON_INTERPRET once,
# when it is first imported (its own library functions are decorated then): set it before anything can
# import triton. Nothing picks a Triton path on a CPU unless a test forces it (kernels/attention/triton_path.py).
# A container may be given /dev/nvidia3 alone: any numbered device node counts.
if not glob.glob("/dev/nvidia[0-9]*") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def megatron_indexed():
    """megatron-core's indexed dataset module (a test dependency)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(
            "megatron.core.datasets.indexed_dataset", reason="needs megatron-core (pip install megatron-core)"
        )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The synthetic Markov corpus (tests/trainer_helpers.py) most training tests run on, once per module."""
    from trainer_helpers import write_markov_corpus

    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


# The longest files (fresh-clone CI, two workers: test_plan ~360 s, test_registry ~150 s, test_block_sparse_attention
# ~140 s, then 60-130 s each) run first. scripts/test.sh gives two xdist workers whole files in collection order
# (--no-loadscope-reorder; xdist would order them by their number of tests), so no long file is handed out
# last to end the run alone on one worker. Order within a file is kept.
LONG_FIRST = ("test_plan.py", "test_registry.py", "test_block_sparse_attention.py", "test_cli_user.py",
              "test_hf_remote.py", "test_pipeline.py", "test_slurm.py", "test_gpu_suite.py", "test_layout_resume.py",
              "test_kill_during_save.py", "test_parallel_layouts.py", "test_custom_ops.py", "test_layout_matrix.py",
              "test_lm_eval.py", "test_compile_blocks.py", "test_export.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # a stable sort
