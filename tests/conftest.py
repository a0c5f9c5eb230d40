import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the project's own `kernels`/`parallel`, never same-named PyPI packages
    sys.path.insert(0, ROOT)


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
