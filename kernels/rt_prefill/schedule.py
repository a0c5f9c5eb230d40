"""The Recurrent Transformer's tile schedule (spec-003 §3.2, Algorithm 1; the leaf-block variant of §3.8).

After position t's output (and so its persistent key) exists, s = t + 1 keys are revealed and
P = lowbit(s) = s & -s: keys [s - P, s) are folded into queries [s, s + P) at once. [s - P, s) and
[s, s + P) are the two halves of an aligned dyadic block of 2P positions, so every pair j < i is folded
exactly once, at the block where j and i part, and before query i is finalised (at step i).

With a leaf block b (a power of two), tiles with P < b are not run; instead query t reads the keys of
its own aligned leaf, [t - t mod b, t), directly before it is finalised. Pairs in different leaves part
at a block of at least 2b, whose tile has P >= b. b = 1 is Algorithm 1 itself.
"""
from __future__ import annotations


def lowbit(s: int) -> int:
    return s & -s


def tiles(N: int, leaf: int = 1) -> list[tuple[int, int, int, int]]:
    """Every tile of a length-N forward in order: (t, key start, key end, query end), run after step t;
    queries start at the keys' end s = t + 1."""
    out = []
    for t in range(N - 1):
        s = t + 1
        P = lowbit(s)
        if P >= leaf:
            out.append((t, s - P, s, min(s + P, N)))
    return out


def leaf_keys(t: int, leaf: int) -> tuple[int, int]:
    """The keys query t reads directly with leaf blocks of size `leaf` (empty for leaf 1)."""
    return t - t % leaf, t


def keys_moved(N: int, leaf: int = 1) -> int:
    """Persistent key rows the tiled forward loads: each tile's P keys, plus each query's leaf keys.
    (N/2) log2 N for N a power of two and leaf 1 (spec §3.4); the naive loop loads N (N - 1) / 2."""
    tiled = sum(k1 - k0 for _, k0, k1, _ in tiles(N, leaf))
    return tiled + sum(t - leaf_keys(t, leaf)[0] for t in range(N))


def naive_keys_moved(N: int) -> int:
    return N * (N - 1) // 2


def check_leaf(leaf: int) -> None:
    if leaf < 1 or leaf & (leaf - 1):
        raise ValueError(f"the RT leaf block must be a power of two >= 1, got {leaf}")
