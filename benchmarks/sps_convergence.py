"""A small reproduction of the SPS paper's direction (spec-001 §6 T11), printed as a table, not asserted.

    PYTHONPATH=. python benchmarks/sps_convergence.py [--steps 250] [--variants sps] [--out /tmp/sps_convergence]

Trains Standard (configs/baseline/tiny with the document mask SPS uses) and SPS (configs/sps/tiny: the
same width, depth and data, w = 8) through the real trainer on the embedded quickstart corpus
(data/quickstart; its tokenizer reserves <predict>) with the same data order, schedule and seed, and
prints the validation loss of each at each evaluation against the step and against the training FLOPs
spent (an SPS step costs about twice a Standard one), so both of the paper's comparisons (per token,
Fig. 1; per compute, Fig. 2 bottom) can be read at this scale (benchmarks/convergence.py). The paper's
gap (-0.04 to -0.07 nats at 53M-1.7B parameters and 20B tokens) is not expected here; spec §6 T11 asks
only that both fall. About 20 minutes on 2 cores for the default two runs.
"""
import argparse

from convergence import add_arguments, compare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, "/tmp/sps_convergence")
    p.add_argument("--variants", nargs="*", default=["sps"],
                   help="SPS-family variants to train beside Standard: sps delayed_state reverse_sps 2x_memory")
    a = p.parse_args()
    runs = {"standard": ("baseline/tiny", ["model.document_mask=true"])}
    runs.update({v: ("sps/tiny", [f"model.variant={v}"]) for v in a.variants})
    compare(runs, a, f"{a.steps} steps of 16 x 256 tokens on data/quickstart, d=256, 4 layers; SPS family w=8")


if __name__ == "__main__":
    main()
