"""A small reproduction of the RT paper's direction (spec-003 §5), printed as a table, not asserted.

    PYTHONPATH=. python benchmarks/rt_convergence.py [--steps 250] [--out /tmp/rt_convergence]

Trains the Recurrent Transformer (configs/rt/tiny: 2 layers, d=128, T=128) and its Transformer row
(the same config with model.recurrent=false: the same blocks and parameter count, attending to their
inputs) through the real trainer on the embedded quickstart corpus, with the same data order, schedule
and seed, and prints the validation loss of each at each evaluation against the step and against the
training FLOPs spent (an RT step projects keys and values twice: +1/6 of the d^2 work), as
benchmarks/convergence.py does. The paper's C4 gaps (RT-12L 3.046 vs T-12L 3.067 at 150M; RT-6L 2.86
vs T-6L 2.917 at 300M) are at 3-6B tokens; here only the direction can show, if at all.
"""
import argparse

from convergence import add_arguments, compare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, "/tmp/rt_convergence")
    a = p.parse_args()
    compare({"transformer": ("rt/tiny", ["model.recurrent=false"]), "rt": ("rt/tiny", [])}, a,
            f"{a.steps} steps of 16 x 128 tokens on data/quickstart, d=128, 2 layers, 4 heads, ALiBi, QK-norm")


if __name__ == "__main__":
    main()
