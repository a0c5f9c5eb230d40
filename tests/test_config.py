"""Run configs: shipped YAMLs load by short name, overrides are typed, validate() speaks one sentence."""
import subprocess
import sys

import pytest

from pretrain.config import ConfigError, config_from_dict, load_config, shipped_configs, to_yaml


def test_shipped_configs_load_by_short_name():
    names = shipped_configs()
    assert {"baseline/tiny", "baseline/xs", "baseline/s", "baseline/m", "baseline/l", "baseline/xl"} <= set(names)
    for name in names:
        cfg = load_config(name, check_data=False)
        # configs/<arch>/ holds that architecture's configs, configs/<task>/ a synthetic task's recipes
        assert cfg.model.arch == name.split("/")[0] or cfg.data.task == name.split("/")[0], name
    xs = load_config("baseline/xs", check_data=False)
    assert (xs.model.d_model, xs.model.n_layers, xs.model.n_heads) == (512, 8, 8)
    assert xs.tokens_per_step == 96 * 4096
    assert xs.train.run_dir == "runs/baseline-xs"  # interpolation resolved


def test_overrides_are_typed_and_round_trip():
    cfg = load_config("baseline/tiny", ["optim.lr=1e-3", "train.max_steps=70", "model.document_mask=true"],
                      check_data=False)
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 70 and cfg.model.document_mask is True
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
    assert "max_steps: 70" in to_yaml(cfg)


def test_a_token_counted_schedule_loads_and_round_trips():
    overrides = ["schedule.kind=wsd_tokens", "schedule.warmup_tokens=102_400", "schedule.decay_tokens=204_800",
                 "schedule.total_tokens=1_024_000"]  # 250 steps x 4096 tokens
    cfg = load_config("baseline/tiny", overrides, check_data=False)
    assert (cfg.schedule.warmup_tokens, cfg.schedule.decay_tokens, cfg.schedule.total_tokens) == (
        102_400, 204_800, 1_024_000)
    assert config_from_dict(cfg.to_dict()) == cfg and "total_tokens: 1024000" in to_yaml(cfg)


def test_the_rt_papers_warmup_cosine_schedule_loads_and_round_trips():
    overrides = ["schedule.kind=warmup_cosine", "schedule.warmup_steps=100", "schedule.warmup_start=0.1",
                 "optim.lr=3e-3", "optim.min_lr=3e-4"]  # 40% of tiny's 250 steps
    cfg = load_config("baseline/tiny", overrides, check_data=False)
    assert (cfg.schedule.kind, cfg.schedule.warmup_steps, cfg.schedule.warmup_start) == ("warmup_cosine", 100, 0.1)
    assert config_from_dict(cfg.to_dict()) == cfg and "warmup_start: 0.1" in to_yaml(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lrr=1"], r"Key 'lrr' not in 'OptimConfig'.*\(at optim.lrr\)"),
        (["train.max_steps=many"], r"could not be converted to Integer \(at train.max_steps\)"),
        (["model.d_model=30"], "model.d_model 30 is not divisible by model.n_heads"),
        (["train.micro_batch_seqs=3"], "train.global_batch_seqs 16 is not divisible by train.micro_batch_seqs 3"),
        (["parallel.tp=3"], r"parallel.tp=3 does not divide model.n_heads = 4"),
        (["parallel.tp=2", "model.n_kv_heads=1"], r"parallel.tp=2 does not divide model.n_kv_heads = 1"),
        (["model.n_kv_heads=3"], r"model.n_kv_heads 3 must divide model.n_heads 4 \(or be 0 for n_heads\)"),
        (["parallel.pp=2", "model.n_layers=3"], "model.n_layers=3 does not split into 2 pipeline stages"),
        (["parallel.pp=0"], "parallel.pp must be >= 1, got 0"),
        (["parallel.sp=true"], "parallel.sp=true splits the sequence over the tensor-parallel group: it needs"),
        (["parallel.zero_stage=2"], "parallel.zero_stage=2 needs parallel.data_parallel=deepspeed"),
        (["parallel.data_parallel=deepspeed"], "parallel.zero_stage must be 1, 2 or 3 with parallel.data_parallel"),
        (["parallel.data_parallel=deepspeed", "parallel.zero_stage=3", "parallel.tp=2"],
         r"deepspeed \(ZeRO-3\) with megatron-core tensor parallelism is not supported"),
        (["parallel.distributed_optimizer=true"], "parallel.distributed_optimizer=true is megatron-core's"),
        (["model.loss_chunk=512", "parallel.tp=2"], r"model.loss_chunk=512 is not used under megatron-core's layers "
         r"\(parallel.tp=2, parallel.megatron_layers=false\): their vocab-parallel loss takes the whole logits"),
        (["model.loss_chunk=512", "parallel.megatron_layers=true"], r"parallel.megatron_layers=true\)"),
        (["parallel.data_parallel=megatron", "train.compile=true"], "train.compile=true is supported with "),
        (["parallel.recompute=some"], "parallel.recompute=some: model.arch 'baseline' offers full"),
        (["parallel.recompute=a-b"], "parallel.recompute must be none, full or a policy the architecture names"),
        (["parallel.data_parallel=fsdp"], "parallel.data_parallel must be one of ddp, megatron, deepspeed"),
        (["model.arch=nope"], "model.arch 'nope' is not a known architecture"),
        (["data.seq_len=512"], "data.seq_len 512 exceeds model.max_seq_len 256"),
        (["optim.min_lr=1.0"], "optim.min_lr must be between 0 and optim.lr"),
        (["schedule.kind=linear"], "schedule.kind must be one of"),
        (["schedule.kind=wsd_tokens"], "schedule.decay_tokens must be positive with schedule.kind=wsd_tokens"),
        (["schedule.kind=wsd_tokens", "schedule.decay_tokens=100000", "schedule.total_tokens=2000000"],
         r"train.max_steps must be ceil\(schedule.total_tokens / tokens per step\) = ceil\(2000000 / 4096\) = 489 "
         r"with schedule.kind=wsd_tokens, got 250; set train.max_steps=489"),
        (["schedule.warmup_tokens=1000"], "schedule.warmup_tokens is used by schedule.kind=wsd_tokens only"),
        (["schedule.warmup_start=0.1"], "schedule.warmup_start is used by schedule.kind=warmup_cosine only"),
        (["schedule.kind=warmup_cosine", "schedule.warmup_start=1.5"],
         r"schedule.warmup_start must be a fraction of optim.lr in \[0, 1\] with schedule.kind=warmup_cosine, got 1.5"),
        (["train.precision=fp8"], "train.precision must be one of auto, fp32, bf16, fp64"),
        (["train.precision=fp64", "parallel.tp=2"], "train.precision=fp64 runs with parallel.data_parallel=ddp, tp=1 "
         "and pp=1 only"),
        (["train.precision=fp64", "parallel.data_parallel=deepspeed", "parallel.zero_stage=1", "train.compile=false"],
         "train.precision=fp64 runs with .* data_parallel=deepspeed"),
        (["data.train=[]"], "data.train is empty"),
        (["data.train=[nowhere/x]"], "dataset 'nowhere/x' not found"),
    ],
)
def test_bad_settings_are_refused_in_one_sentence(overrides, message):
    check = any(o.startswith("data.train") for o in overrides)
    with pytest.raises(ValueError, match=message) as e:
        load_config("baseline/tiny", overrides, check_data=check)
    assert "\n" not in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="neither a file, a run directory nor a shipped config; did you mean baseline/"):
        load_config("baseline/huge")
    with pytest.raises(ConfigError, match="is a directory without a config.yaml: not a run directory"):
        load_config(str(tmp_path))


SECRET = "root:x:0:0:root:/root:/bin/bash"  # what must never reach an error message


@pytest.mark.parametrize("content, message", [
    (f"{SECRET}\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n".encode(), "is not a YAML mapping of sections"),
    (b"", "is empty; expected a YAML mapping of sections"),
    (b"  \n\n", "is empty; expected a YAML mapping of sections"),
    (b"\x7fELF\x02\x01\x01\x00" + SECRET.encode() + b"\x00\x00", "is a binary file; expected a YAML mapping"),
    (b"train:\n  name: caf\xe9 " + SECRET.encode(), "is not UTF-8 text; expected a YAML mapping"),
    (b"42\n", "is not a YAML mapping of sections"),
    (f"- {SECRET}\n- b\n".encode(), "is not a YAML mapping of sections"),
    (f"model: [{SECRET}\n".encode(), r"is not valid YAML \(line 2, column 1\); expected a YAML mapping"),
    (f"model: {SECRET}\n".encode(), "section model is not a mapping of fields"),
])
def test_a_file_that_is_not_a_config_is_named_never_echoed(tmp_path, content, message):
    path = tmp_path / "not-a-config.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    assert "root:" not in str(e.value) and "daemon" not in str(e.value) and "ELF" not in str(e.value)


def test_cli_train_on_a_system_file_prints_one_line(tmp_path):
    path = tmp_path / "passwd"
    path.write_text(f"{SECRET}\n" * 30)
    out = subprocess.run([sys.executable, "-m", "pretrain.cli", "train", str(path)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "root:" not in out.stderr + out.stdout
    assert f"config {path} is not a YAML mapping of sections" in out.stderr


def test_cli_info_json_and_help():
    out = subprocess.run([sys.executable, "-m", "pretrain.cli", "info", "baseline/xs", "--json"],
                         capture_output=True, text=True, check=True).stdout
    import json

    info = json.loads(out)
    assert info.pop("flops_formula").startswith("6 * (L * (2 d^2 + 2 d d_kv + 3 d f) + V d) + 12 * L * d * T")
    assert info == {"params_total": 53_027_328, "params_embedding": 50304 * 512,
                    "params_non_embedding": 53_027_328 - 50304 * 512,
                    "flops_per_token": 6.0 * (8 * 13 * 512 * 512 + 50304 * 512) + 12.0 * 8 * 512 * 4096}
    text = subprocess.run([sys.executable, "-m", "pretrain.cli", "info", "baseline/xs"],
                          capture_output=True, text=True, check=True).stdout
    assert "FLOPs per token = 6 * (L * (2 d^2 + 2 d d_kv + 3 d f) + V d) + 12 * L * d * T" in text  # the registry's
    bad = subprocess.run([sys.executable, "-m", "pretrain.cli", "info", "baseline/xs", "optim.lrr=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "optim.lrr" in bad.stderr


def test_cli_help_does_not_import_torch():
    code = "import sys; from pretrain.cli import _parser; _parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
