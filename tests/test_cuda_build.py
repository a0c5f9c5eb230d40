"""The Triton kernels compiled for NVIDIA GPUs on this CPU (kernels/cuda_build.py): every launch
configuration the launch code picks fits the GPU's shared memory, and those the shipped configs launch
spill no registers. The interpreter the other kernel tests run on checks neither."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="compiling kernels needs Triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_RT_HEAD_DIMS = (32, 64, 128)  # head-dim blocks of RT's configs: tiny 32, 300m 64, 150m-6l 90 -> 128


def _build(tmp_path, *args) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it for the others
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "kernels.cuda_build", *args, "--json", str(out)], cwd=ROOT,
                       env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=900)
    return r, json.loads(out.read_text()) if out.exists() else []


def _check(rows: list[dict]) -> None:
    from kernels.triton_support import flash_tiles, pow2_block

    assert rows and all(r["registers"] > 0 and r["stack"] >= 0 for r in rows), rows  # cuobjdump read each binary
    assert all(r["blocks_per_sm"] >= 1 for r in rows), rows
    for r in rows:
        op, dtype, dims = r["variant"].split()[:3]
        if op == "attention":  # what was compiled is what the launch code picks on a GPU (the recorder saw it)
            bm, bn, warps, stages = flash_tiles(int(dims), dtype != "fp32")
            assert f"BM={bm} BN={bn} BD={pow2_block(int(dims))}" in r["config"], r
            assert r["config"].endswith(f"warps={warps} stages={stages}"), r
        # a register or two (Triton 3.6 spills 8 bytes in a few); the RT tile's forward at head dims no RT config
        # uses, up to 192; 64 x 64 fp32 tiles had spilled 13 KB
        shipped = op != "rt_tile" or int(dims) in SHIPPED_RT_HEAD_DIMS
        assert r["stack"] <= (16 if shipped else 256), r


def test_the_kernels_compile_for_sm90_within_shared_memory_and_without_spills(tmp_path):
    """CI's share (half a minute): what bf16 autocast training launches, attention, the RT tile (fp32
    queries and state, bf16 keys) and the memory step; fp32, fp16 and sm_80 are in the slow test below."""
    r, rows = _build(tmp_path, "--dtype", "bf16")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert {row["variant"].split()[0] for row in rows} == {"attention", "rt_tile", "delta_memory"}
    assert "| attention bf16 64 | _bwd_kv |" in r.stdout and "limit 227 KiB" in r.stdout
    _check(rows)


@pytest.mark.slow
def test_every_configuration_compiles_for_sm80_and_sm90(tmp_path):
    r, rows = _build(tmp_path, "--arch", "80", "--arch", "90")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert {row["arch"] for row in rows} == {80, 90} and {row["variant"].split()[1] for row in rows} == \
        {"bf16", "fp16", "fp32"}
    _check(rows)


def test_a_configuration_over_the_limits_is_named(tmp_path):
    from kernels.cuda_build import Built

    assert Built("v", "k", "c", shared=240_000, registers=255, stack=0).verdict(90, None) == \
        "does not fit: 234 KiB of shared memory, sm_90 has 227 KiB"
    assert Built("v", "k", "c", shared=1024, registers=255, stack=96).verdict(90, 64) == \
        "spills: 96 bytes a thread, over --max-stack 64"
    fwd = Built("v", "k", "c", shared=42_803, registers=130, stack=0, warps=4)  # bf16 attention at head dim 64
    assert fwd.blocks_per_sm(90) == 3  # by registers: 17 x 256 a warp, so 15 warps, 3 blocks of 4
    assert Built("v", "k", "c", shared=1024, registers=255, stack=0, warps=16).verdict(90, None) == \
        "does not fit: 255 registers x 512 threads, over an SM's 65,536"
    assert Built("v", "k", "c", error="CompilationError: x").verdict(80, None) == \
        "does not compile: CompilationError: x"
    r, rows = _build(tmp_path, "--op", "rt_tile", "--dtype", "fp32", "--head-dim", "256", "--max-stack", "0")
    assert r.returncode == 1 and any(row["verdict"].startswith("spills") for row in rows), r.stdout
    assert "would fail or spill past the limit on the GPU" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kernels.cuda_build"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1"))
    assert r.returncode == 2 and "unset TRITON_INTERPRET" in r.stderr
