"""The dry run and the planner's formulas (pretrain/plan.py, parallel/plan.py): a large layout is built
and shape-checked on the meta device in seconds, and the weight, gradient and optimizer-state bytes the
planner gives each rank equal what a real run's ranks hold, on one process, PP2 and TP2."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from distributed import run_ranks
from trainer_helpers import tiny_overrides, write_markov_corpus

pytest.importorskip("megatron.core", reason="the dry run sets up megatron-core's parallel state")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.cli", "plan", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, timeout=300)


def test_sps_l_on_64_gpus_is_dry_run_in_seconds():
    t0 = time.perf_counter()
    r = _plan("sps/l", "--dry-run", "--layout", "tp=4,pp=2,dp=8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert time.perf_counter() - t0 < 60
    lines = r.stdout.splitlines()
    assert lines[0].startswith("dry run of sps on 64 ranks = tp 4 x pp 2 x dp 8")
    stages = [ln.split() for ln in lines[2:4]]
    assert [s[0] for s in stages] == ["0", "1"] and stages[0][1] == "0-31" and stages[1][1] == "32-63"
    assert "[3, 8192, 1280]" in lines[2] and lines[3].endswith("the loss")  # SPS's doubled sequence goes on


def test_a_layout_that_does_not_fit_is_one_sentence():
    r = _plan("sps/xl", "--dry-run", "--layout", "tp=2,pp=2,dp=16")
    assert r.returncode == 2 and r.stderr.strip() == "pretrain plan: error: parallel.tp=2 does not divide model.n_heads = 25"
    r = _plan("sps/xl", "--dry-run", "--layout", "tp=four")
    assert r.returncode == 2 and "give tp=N,pp=N,dp=N with positive integers" in r.stderr


def _shipped_archs() -> list[str]:
    from pretrain.models import all_archs

    return [s.name for s in all_archs() if not s.name.startswith("test_")]


@pytest.mark.parametrize("arch", _shipped_archs())
def test_every_architecture_is_planned_and_dry_run(arch):
    """No architecture is left out of the planner (GPN's traceback, CRT's draw on meta tensors): the --gpus
    table proposes a layout, a refused parallel feature is a one-line refusal naming its sizes, and the
    default dry run (one rank) builds the model and shape-checks a step."""
    from pretrain.models import get_arch

    r = _plan(f"{arch}/tiny", "--gpus", "8")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert any(line.startswith("proposed: parallel.tp=") for line in r.stdout.splitlines()), r.stdout[-1500:]
    supports = get_arch(arch).supports
    for feature, sizes in (("pp", "2,4,8"), ("tp", "2,4,8")):
        if not getattr(supports, feature):
            refusal = f"parallel.{feature}={sizes} is not supported ({supports.reasons.get(feature, '')}"
            assert any(line.startswith("refused (") and refusal in line for line in r.stdout.splitlines()), refusal
    dry = _plan(f"{arch}/tiny", "--dry-run", "train.micro_batch_seqs=2")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert dry.stdout.startswith(f"dry run of {arch} on 1 ranks = tp 1 x pp 1 x dp 1")
    assert dry.stdout.splitlines()[2].rstrip().endswith("the loss")


def _held(rank, world, tmp, corpus, extra):
    """The bytes this rank's engine holds: weights, the gradients of one step, the optimizer's state."""
    import torch

    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    over = tiny_overrides(tmp, corpus, **{"train.run_dir": f"{tmp}/run", "train.max_steps": 1,
                                          "checkpoint.every": 0, "train.eval_every": 0, "train.compile": "false",
                                          "schedule.warmup_steps": 0})
    trainer = Trainer(load_config("baseline/tiny", over + extra), log=lambda *_: None)
    grads = []
    zero_grad = trainer.engine.zero_grad

    def measure_then_zero():
        grads.append(sum(p.grad.numel() * p.grad.element_size() for p in trainer.engine.model.parameters()
                         if p.grad is not None))
        zero_grad()

    trainer.engine.zero_grad = measure_then_zero
    trainer.save = lambda: None
    trainer.fit()
    engine = trainer.engine
    params = {id(p): p for p in engine.model.parameters()}.values()
    optimizers = [engine.optimizer]
    megatron = getattr(engine, "dp_engine", engine)  # megatron's DDP: gradients in its buffers, its optimizers
    if isinstance(getattr(megatron.wrapped, "buffers", None), list):
        grads = [sum(b.grad_data.numel() * b.grad_data.element_size() for b in megatron.wrapped.buffers)]
        optimizers = [o.optimizer for o in getattr(megatron.optimizer, "chained_optimizers", [megatron.optimizer])]
    state = [t for o in optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"weights": sum(p.numel() * p.element_size() for p in params), "gradients": grads[0],
            "optimizer": sum(t.numel() * t.element_size() for t in state), "scalars": sum(t.dim() == 0 for t in state)}


# pp=2 alone and megatron's dp=2 alone are parts of the two pp=2,dp=2 layouts: slow, so CI runs every engine once
SUBSET = pytest.mark.slow


@pytest.mark.parametrize("layout, ranks, extra", [
    ("tp=1", 1, []), pytest.param("pp=2", 2, ["parallel.pp=2"], marks=SUBSET), ("tp=2", 2, ["parallel.tp=2"]),
    ("pp=2,dp=2", 4, ["parallel.pp=2"]),
    pytest.param("dp=2", 2, ["parallel.data_parallel=megatron"], marks=SUBSET),
    ("pp=2,dp=2", 4, ["parallel.pp=2", "parallel.data_parallel=megatron"]),
])
def test_the_planners_state_bytes_equal_what_each_rank_holds(layout, ranks, extra, tmp_path):
    corpus = write_markov_corpus(tmp_path / "markov")
    over = tiny_overrides(tmp_path, corpus)
    r = _plan("baseline/tiny", *over, *extra, "--dry-run", "--layout", layout, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    planned = [json.loads(line) for line in r.stdout.splitlines()]
    held = run_ranks(_held, ranks, args=(str(tmp_path), corpus, extra), timeout=300, env={"DS_ACCELERATOR": "cpu"})
    for rank, got in enumerate(held):
        stage = planned[rank // (ranks // len(planned))]  # stages are the slowest rank dimension
        got.pop("scalars")
        assert got == {k: stage[k] for k in ("weights", "gradients", "optimizer")}, (rank, got, stage)


@pytest.mark.parametrize("layout, ranks, extra", [pytest.param("dp=2", 2, [], marks=SUBSET),
                                                   ("pp=2,dp=2", 4, ["parallel.pp=2"])])
def test_the_distributed_optimizers_bytes_are_the_planners_up_to_megatrons_padding(layout, ranks, extra, tmp_path):
    """megatron's distributed optimizer: weights exactly 4n; its gradient buffer 4n plus the padding the
    planner leaves out (each parameter's start aligned to 64 elements, the bucket's end to a multiple of
    lcm(dp, 128)); the Adam state over the data-parallel ranks exactly 8n plus a 4-byte step per shard,
    so the planner's 8n/dp is each rank's average."""
    corpus = write_markov_corpus(tmp_path / "markov")
    extra = [*extra, "parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"]
    r = _plan("baseline/tiny", *tiny_overrides(tmp_path, corpus), *extra, "--dry-run", "--layout", layout, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    planned = [json.loads(line) for line in r.stdout.splitlines()]
    held = run_ranks(_held, ranks, args=(str(tmp_path), corpus, extra), timeout=300)
    for s, stage in enumerate(planned):
        ranks_of_stage = held[2 * s:2 * s + 2]  # dp = 2, the fastest rank dimension after tp
        n, k = stage["params"], stage["tensors"]
        for got in ranks_of_stage:
            assert got["weights"] == stage["weights"] == 4 * n
            assert 0 <= got["gradients"] - stage["gradients"] < 4 * (64 * k + 128), (got, stage)
        assert sum(g["optimizer"] for g in ranks_of_stage) == 2 * stage["optimizer"] + \
            4 * sum(g["scalars"] for g in ranks_of_stage), (ranks_of_stage, stage)


def _measured_peak(arch: str, policy: str, overrides: list[str], bf16: bool = False, batch: int = 0) -> tuple[int, int]:
    """(LiveBytes peak of one micro batch's forward and backward, the registry's fp32 estimate); `bf16`: under
    CPU bf16 autocast; `batch`: the micro batch (0: the config's)."""
    import torch

    from live_memory import step_peak
    from pretrain.config import load_config
    from pretrain.models import get_arch

    cfg = load_config(f"{arch}/tiny", overrides, check_data=False)
    spec = get_arch(arch)
    torch.manual_seed(0)
    model = spec.build(cfg.model).train()
    if policy != "none":
        spec.recompute_policies()[policy].apply(model)
    B, T = batch or cfg.train.micro_batch_seqs, cfg.data.seq_len
    tokens = torch.randint(5, cfg.model.vocab_size, (B, T))
    for p in model.parameters():  # gradients exist before: the backward only adds into them
        p.grad = torch.zeros_like(p)
    # lazily built tables (RoPE, masks) are not activations: one sequence builds them (they depend on T, not B;
    # every case's peak is the same as after a warm-up on the whole batch, at a fraction of its time)
    step_peak(model, tokens[:1], bf16)
    return step_peak(model, tokens, bf16), spec.activation_bytes(cfg.model, T, B, policy)


VARIANT = ["model.n_layers=2", "model.ffn_hidden=1024", "data.seq_len=128"]
ESTIMATES = [(arch, policy, over) for arch in ("baseline", "sps") for policy in ("none", "full") for over in ([], VARIANT)]
ESTIMATES += [("rt", "none", []), ("rt", "none", ["model.n_layers=4", "model.ffn_hidden=1024"]),
              ("rt", "none", ["model.recurrent=false"]), ("rt", "full", ["model.recurrent=false"])]
ESTIMATES += [("cart", policy, over) for policy in ("none", "pass", "loop", "block")
              for over in ([], ["model.n_layers=4", "model.n_loops=2", "model.ffn_hidden=768"])]
ESTIMATES += [("gpn", policy, over) for policy in ("none", "full") for over in ([], ["model.n_layers=2"])]
# GPN's segments at shapes where the window's [T, d] tensors (a long window, a small memory) and the folded
# matrices (a wide state and FFN, two layers) weigh most: the estimate was 0.57 and 0.62 of these peaks
GPN_SMALL = ["model.vocab_size=512", "model.d_emb=64"]
ESTIMATES += [("gpn", "full", [*GPN_SMALL, "model.mem_heads=1", "model.d_key=8", "model.d_value=8", "model.d_state=256",
                               "model.d_ffn=512", "data.seq_len=1024"]),
              ("gpn", "full", [*GPN_SMALL, "model.mem_heads=6", "model.d_key=32", "model.d_value=32", "model.d_state=384",
                               "model.d_ffn=768", "data.seq_len=512", "model.n_layers=2"])]
ESTIMATES += [("crt", policy, ["model.k_min=0", *over]) for policy in ("none", "full", "block")  # K = k_max
              for over in ([], ["model.n_layers=4", "model.k_max=2"])]
# model.loss_chunk (kernels/lm_loss's memory_columns): the loss keeps no logits, one chunk's at a time
ESTIMATES += [(arch, policy, ["model.loss_chunk=256", *over]) for arch, policy, over in (
    ("baseline", "none", []), ("baseline", "full", []), ("sps", "none", []), ("cart", "none", []), ("cart", "pass", []),
    ("crt", "none", ["model.k_min=0"]), ("gpn", "full", []), ("rt", "none", []), ("rt", "none", ["model.recurrent=false"]))]


@pytest.mark.parametrize("arch, policy, overrides", ESTIMATES)
def test_the_activation_estimate_is_within_15_percent_of_the_measured_peak(arch, policy, overrides):
    """Each architecture's tiny config (and a variant) under each recompute policy it allows: the
    registry's activation_bytes against the peak of live tensor bytes over one micro batch's forward
    and backward."""
    measured, estimate = _measured_peak(arch, policy, overrides)
    assert abs(estimate / measured - 1) < 0.15, (estimate, measured)


BF16_SHAPES = {"decoder": [["model.d_model=256", "model.n_heads=4", "model.vocab_size=8192", "data.seq_len=256",
                             "model.max_seq_len=256", "model.n_layers=2"],
                            ["model.d_model=192", "model.n_heads=4", "model.vocab_size=4096", "data.seq_len=128",
                             "model.max_seq_len=128", "model.n_layers=3"]],
               "own": [["model.vocab_size=8192", "data.seq_len=256"],
                       ["model.vocab_size=4096", "data.seq_len=128", "model.n_layers=3"]]}
BF16_CASES = [(arch, policy, extra, shape)
              for arch, policy, extra in (("baseline", "none", []), ("sps", "none", []), ("cart", "none", []),
                                          ("rt", "none", []), ("rt", "none", ["model.recurrent=false"]),
                                          ("crt", "none", ["model.k_min=0"]), ("gpn", "none", []), ("gpn", "full", []),
                                          ("baseline", "none", ["model.loss_chunk=512"]),
                                          ("rt", "none", ["model.loss_chunk=512"]))
              for shape in BF16_SHAPES["own" if arch in ("crt", "gpn") else "decoder"]]


@pytest.mark.parametrize("arch, policy, extra, shape", BF16_CASES)
def test_the_bf16_activation_estimate_is_within_15_percent_of_the_peak_under_cpu_autocast(arch, policy, extra, shape):
    """The planner's bf16 figure (pretrain/plan.py's bf16_activations: the logits as in fp32, the rest times the
    registry's bf16_kept) against LiveBytes' peak under CPU bf16 autocast (a stand-in for CUDA's, whose op
    lists differ a little; the GPU suite's planner column checks CUDA), at two shapes with a vocabulary large
    enough that the logits matter. Halving the fp32 figure, as the planner did, gave 0.3 to 0.6 of the peak."""
    from pretrain.config import load_config
    from pretrain.models import get_arch
    from pretrain.plan import bf16_activations

    overrides = [*shape, *extra]
    measured, fp32 = _measured_peak(arch, policy, overrides, bf16=True, batch=8)
    cfg = load_config(f"{arch}/tiny", overrides, check_data=False)
    estimate = bf16_activations(cfg.model, fp32, 8 * cfg.data.seq_len, get_arch(arch).bf16_kept(policy))
    assert abs(estimate / measured - 1) < 0.15, (estimate, measured)


def test_the_planner_proposes_the_fastest_layout_that_fits_and_its_help_states_the_formulas():
    r = _plan("sps/xl", "--gpus", "64")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    assert out[0].startswith("plan for sps (1,678,081,600 parameters) on 64 x H100 SXM 80 GB")
    proposal = next(line for line in out if line.startswith("proposed: "))
    assert "parallel.tp=1" in proposal and "MFU" in proposal  # 25 heads: only TP1 divides
    header = out[1].split()
    fit_col, speed_col = header.index("fits"), header.index("tokens/s/GPU")
    rows = [line.split() for line in out[2:] if line.strip()[:1].isdigit()]
    fits = [row for row in rows if row[fit_col] == "yes"]
    speed = lambda row: float(row[speed_col].replace(",", ""))  # noqa: E731
    assert fits and rows[0] is fits[0] and all(speed(rows[0]) >= speed(row) for row in fits)
    tight = _plan("sps/xl", "--gpus", "8", "--gpu-memory", "8")  # 1.7B parameters x 16 bytes on 8 GPUs
    assert tight.returncode == 0 and "no layout fits" in tight.stdout, tight.stdout[-1500:]
    helped = subprocess.run([sys.executable, "-m", "pretrain.cli", "plan", "--help"], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, timeout=60).stdout
    for formula in ("optimizer 8n + 4k", "12n/dp", "bubble", "eta", "2 (tp-1)/tp"):
        assert formula in helped, formula
    bad = _plan("sps/xl", "--gpus", "8", "--dry-run")
    assert bad.returncode == 2 and "either --gpus N (the planner) or --dry-run" in bad.stderr


def test_the_serial_loop_constants_reproduce_rts_published_latency_table():
    """parallel/plan.py fits a step latency and kappa to the paper's per-layer forward latencies; the
    fitted line must give the table back (within 2%), and the constants must be of the fitted size."""
    from parallel.plan import (HARDWARE, RT_LAYER_FORWARD_MS, RT_TABLE_SHAPE, SERIAL_KAPPA, SERIAL_STEP_S, efficiency,
                               fit_serial_constants)

    assert (SERIAL_STEP_S, SERIAL_KAPPA) == fit_serial_constants()
    assert 20e-6 < SERIAL_STEP_S < 100e-6 and 0.1 < SERIAL_KAPPA < 0.5
    d, f, T = RT_TABLE_SHAPE["d"], RT_TABLE_SHAPE["f"], RT_TABLE_SHAPE["T"]
    hw = HARDWARE["h100"]
    rate = hw.peak_tflops * 1e12 * efficiency(hw, d)
    for b, ms in RT_LAYER_FORWARD_MS.items():
        model = T * SERIAL_STEP_S + b * T * ((6 * d * d + 4 * d * f + 2 * d * T) / SERIAL_KAPPA + 6 * d * d) / rate
        assert model * 1e3 == pytest.approx(ms, rel=0.02), b


@pytest.mark.parametrize("micro", [32, 128])
def test_a_position_serial_loop_pays_its_latency_per_micro_batch(micro):
    """RT's layers step through positions (its registry serial_loop): a smaller micro batch pays the steps'
    latency more often, so its predicted throughput falls; the Transformer of the same shape (no serial
    loop) does not care. The predicted RT step holds exactly the formula's latency term."""
    from parallel.plan import SERIAL_STEP_S
    from pretrain.config import load_config
    from pretrain.models import get_arch
    from pretrain.plan import predict

    def at(config, mb):
        cfg = load_config(config, ["train.compile=false", f"train.micro_batch_seqs={mb}"], check_data=False)
        return cfg, predict(cfg, 1, "h100")

    cfg, whole = at("rt/300m-12l", 512)
    _, small = at("rt/300m-12l", micro)
    steps, _ = get_arch("rt").serial_loop(cfg.model, cfg.data.seq_len)
    assert steps == cfg.model.n_layers * cfg.data.seq_len
    M = 512 // micro
    assert small.step.compute_s - whole.step.compute_s == pytest.approx((M - 1) * steps * 2 * SERIAL_STEP_S, rel=1e-6)
    assert small.tokens_per_s_per_gpu < 0.95 * whole.tokens_per_s_per_gpu
    _, t_whole = at("rt/t-300m-12l", 512)
    _, t_small = at("rt/t-300m-12l", micro)
    assert t_small.step.compute_s == pytest.approx(t_whole.step.compute_s, rel=1e-9)


@pytest.mark.parametrize("config, batch", [("rt/300m-12l", 512), ("gpn/gpn-m-130m", 128)])
def test_the_planner_offers_micro_batches_up_to_the_whole_batch(config, batch):
    """A position-serial loop pays its latency once per micro batch, so RT's and GPN's plans on one GPU take the
    largest micro batch that fits: the recipe's whole batch (RT 512, GPN 128), above the 64 the planner once
    capped it at; every divisor of the per-rank batch is a candidate."""
    from parallel.plan import HARDWARE
    from pretrain.config import load_config
    from pretrain.plan import candidates

    cfg = load_config(config, [], check_data=False)
    assert cfg.train.global_batch_seqs == batch
    found, _ = candidates(cfg, 1, HARDWARE["h100"], 80)
    assert {c.micro_batch for c in found} == {k for k in range(1, batch + 1) if batch % k == 0}
    best = found[0]
    assert best.fits and best.micro_batch == max(c.micro_batch for c in found if c.fits) > 64


def test_the_captured_loops_buffers_count_only_where_a_layout_captures():
    """The planner adds the registry's captured_bytes (tests/test_captured.py checks them against the regions'
    buffers) only where the run captures: train.cuda_graphs not off, GPN under parallel.recompute=full (its
    segments are the regions), and no pipeline stages (kernels/captured.why_not refuses them)."""
    from dataclasses import replace

    from pretrain.config import load_config
    from pretrain.models.registry import get_arch
    from pretrain.plan import captured_static_bytes

    gpn = load_config("gpn/gpn-m-130m", [], check_data=False)
    spec = get_arch("gpn")
    held = spec.captured_bytes(gpn.model, 2048, 128)
    assert captured_static_bytes(gpn, spec, gpn.parallel, 128) == held > 2 * 2**30  # 2,786 MiB on the H200
    assert captured_static_bytes(gpn, spec, replace(gpn.parallel, recompute="none"), 128) == 0
    off = load_config("gpn/gpn-m-130m", ["train.cuda_graphs=off"], check_data=False)
    assert captured_static_bytes(off, spec, off.parallel, 128) == 0
    rt = load_config("rt/300m-12l", [], check_data=False)
    rt_spec = get_arch("rt")
    assert captured_static_bytes(rt, rt_spec, rt.parallel, 512) == rt_spec.captured_bytes(rt.model, 512, 512) > 0
    assert captured_static_bytes(rt, rt_spec, replace(rt.parallel, pp=2), 512) == 0


@pytest.mark.parametrize("pp, virtual, M", [(2, 1, 8), (4, 1, 2), (4, 2, 8), (8, 2, 16), (4, 3, 12), (4, 2, 4)])
def test_the_planners_micro_batches_in_flight_are_megatrons_warm_up(pp, virtual, M):
    """in_flight x v - 1 (the steady state's one forward taken off) is the warm-up megatron-core's
    schedules run on each pipeline rank, capped at the step's forwards."""
    from types import SimpleNamespace

    pytest.importorskip("megatron.core")
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from parallel.plan import in_flight

    for rank in range(pp):
        group = SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r)
        p2p = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None)
        total, all_warm, warm, _ = get_pp_rank_microbatches(M, virtual, pp, p2p_communicator=p2p)
        expected = total if all_warm else warm + 1
        assert in_flight(pp, rank, M, virtual) * virtual == min(expected, total), (rank, warm, total)


@pytest.mark.slow  # a benchmark's output (13 s); CI stands at its 25-minute mark
def test_activation_peak_prints_each_batch_beside_the_planner_and_notes_a_chunk_the_batches_do_not_pass():
    """benchmarks/activation_peak.py on RT's tiny config: a row per batch, the carried line, and the note when
    model.loss_chunk is not below the smallest batch's positions (the loss's peak stops growing there)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks/activation_peak.py"), "rt/tiny", "--batches", "1,2", "--fp32"]
    r = subprocess.run([*cmd, "model.loss_chunk=256"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("rt/tiny model.loss_chunk=256: rt, T 128, fp32, recompute none")
    assert lines[1].startswith("note: model.loss_chunk=256 is not below the smallest batch's 128 positions")
    rows = [line.split() for line in lines[3:5]]
    assert [row[0] for row in rows] == ["1", "2"] and all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows)
    # each row names the code at its peak (with the chunk this large, the loss's forward)
    assert all(re.fullmatch(r"kernels/lm_loss/\w+\.py:\w+:\d+", row[-1]) for row in rows), rows
    assert lines[-1].startswith("per sequence ") and "at the config's micro batch" in lines[-1]


def test_activation_peak_measures_under_the_configs_recompute_policy():
    """activation_peak.py said "recompute full" for GPN's configs but measured without the segments (0.72 of
    the planner's figure at gpn/tiny, T 512; at gpn-m-130m's window it ran out of 24 GB at one sequence): it
    applies the config's policy as the trainer does, and its figure meets the planner's."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks/activation_peak.py"), "gpn/tiny", "--batches", "1,2", "--fp32",
           "data.seq_len=512"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert "recompute full" in lines[0], lines[0]
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["1", "2"] and all(0.9 < float(row[3]) < 1.1 for row in rows), rows


def test_live_bytes_names_the_code_running_at_the_peak():
    from live_memory import LiveBytes

    def small():
        return torch.ones(100)

    def large():
        return torch.ones(10_000)

    with LiveBytes(where=True) as live:
        kept = small()
        dropped = large()
        del dropped
        kept = kept + small()  # less than large() made: no new peak
    assert live.where.startswith("tests/test_plan.py:large:"), live.where
    assert LiveBytes().where is None  # not asked for: no frame walked at each new peak
