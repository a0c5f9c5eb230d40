"""The main of a benchmark made of sections (bench_rt, bench_cart, bench_gpn): positional section names
(or all), --quick, child verbs that run one measurement in a fresh process, the header line, the total."""
from __future__ import annotations

import os
import time
from typing import Callable


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def run(parser, sections: tuple[str, ...], namespace: dict, children: dict[str, Callable] | None = None,
        quick: Callable | None = None, note: str = "fresh processes: glibc malloc") -> None:
    """Parse the command line (`what` positional, --quick, --threads), then run either one child verb
    (a measurement in this fresh process) or the sections asked for, in `sections`' order, each as
    namespace[f"bench_{section}"](args)."""
    import torch

    children = children or {}
    a = parser.parse_args()
    a.what = a.what or ["all"]
    bad = [w for w in a.what if w not in ("all", *sections, *children)]
    if bad:
        parser.error(f"unknown section {', '.join(bad)}; choose from all, {', '.join(sections)}")
    if a.quick and quick is not None:
        quick(a)
    torch.set_num_threads(a.threads)
    for verb, fn in children.items():
        if verb in a.what:
            return fn(a)
    from pretrain.malloc import active_allocator, use_caching_allocator

    use_caching_allocator()  # as `pretrain train` does (may re-execute the script once)
    what = sections if "all" in a.what else [s for s in sections if s in a.what]
    started = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), allocator {active_allocator()} "
          f"({note}), {load()}", flush=True)
    for section in what:
        namespace[f"bench_{section}"](a)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
