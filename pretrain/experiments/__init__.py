"""Experiments as objects: the run database (`pretrain runs`), comparisons (`pretrain compare`) and the
papers' tables as recipes (`pretrain repro`).

    index.py    every run directory under a root, indexed into one SQLite file, incrementally
    query.py    typed --where filters, columns and the table/csv/json printers over the indexed runs
    compare.py  runs grouped by config fields: final figures with mean and spread, and their curves
    recipes.py  a paper's table as a grid of runs: plan, run (locally or as a Slurm array), report
"""
