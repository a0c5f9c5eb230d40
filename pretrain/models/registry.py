"""One entry per architecture: what the trainer, planner, generator and exporter may ask of it.

The rest of the code reads this registry and never branches on an architecture's name. A model
module registers itself when imported (`register(ArchSpec(...))` at its end); the registry imports
every module of the pretrain.models package, and those named by the `pretrain.architectures` entry
point group of installed packages, the first time it is asked, so adding an architecture edits no
shared list.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

from parallel.recompute import Recompute, as_policy


@dataclass(frozen=True)
class Support:
    """Parallel features an architecture supports; a refused feature carries its reason."""

    tp: bool = True
    sp: bool = True
    pp: bool = False
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    reasons: dict[str, str] = field(default_factory=dict)  # feature -> why it is refused

    def __post_init__(self):
        # A refused feature must say why (the refusal sentence quotes it); pipeline parallelism refused
        # without a reason of its own is refused for the lack of a registry `pipeline_split`.
        refused = [f for f, ok in (("tp", self.tp), ("sp", self.sp)) if not ok]
        refused += ["zero"] if set(self.zero_stages) != {0, 1, 2, 3} else []
        missing = [f for f in refused if not self.reasons.get(f)]
        if missing:
            raise ValueError(f"Support refuses {', '.join(missing)} without a reason in `reasons`")

    def refusal(self, parallel) -> str | None:
        """Why this architecture cannot run under `parallel` (a ParallelConfig), or None."""
        reasons = {"pp": "the architecture has no pipeline stages: no pipeline_split in its registry entry",
                   **self.reasons}
        asks = [("pp", parallel.pp > 1 and not self.pp, f"parallel.pp={parallel.pp}"),
                ("tp", parallel.tp > 1 and not self.tp, f"parallel.tp={parallel.tp}"),
                ("sp", parallel.sp and not self.sp, "parallel.sp=true"),
                ("zero", parallel.zero_stage not in self.zero_stages, f"parallel.zero_stage={parallel.zero_stage}")]
        for feature, refused, setting in asks:
            if refused:
                return f"{setting} is not supported ({reasons[feature]})"
        return None


@dataclass(frozen=True)
class DecodeRelation:
    """How the streaming decode (new_state/step) relates to the parallel forward's logits: "exact"
    (equal up to float64 rounding; the paper proves it) or "tolerance" (within atol, for the reason
    in `why`). The registry-wide tests hold every architecture to its declaration."""

    kind: str = "exact"
    atol: float = 1e-9
    why: str = ""
    # Model-config overrides under which the relation holds (CRT's parallel forward equals streaming
    # only with enough passes: {"eval_k": -1}); the tests build the model with them.
    config: dict = field(default_factory=dict)


# -- the defaults of the optional hooks: each works, so no caller checks for None ------------------
def _model_new_state(model, batch_size: int):
    return model.new_state(batch_size)


def _model_step(model, tokens, state):
    return model.step(tokens, state)


def _model_logits(model, tokens):
    return model.logits(tokens)


def _decoder_tp_dims(cfg) -> dict[str, int]:
    """A decoder-shaped config's (pretrain/models/decoder.py tp_dims); nothing for another shape."""
    from pretrain.models.decoder import DecoderConfig, tp_dims

    return tp_dims(cfg) if isinstance(cfg, DecoderConfig) else {}


def _no_pipeline(cfg, pp: int) -> list:
    raise ValueError(f"model.arch {cfg.arch!r} has no pipeline stages (no pipeline_split in its registry entry)")


def _no_conversion(source_arch: str, source_cfg, source_state: dict, target_cfg) -> dict:
    raise ValueError(f"model.arch {target_cfg.arch!r} has no conversion from another architecture (no `convert` in "
                     "its registry entry)")


class NoHF:
    """The `hf` adapter of an architecture without a Hugging Face counterpart: export refuses it."""

    model_type = None

    def check_export(self, cfg) -> None:
        raise ValueError(f"--format hf: model.arch {cfg.arch!r} has no Hugging Face counterpart (its registry entry "
                         "names no `hf` adapter); export it in the native format")


@dataclass(frozen=True)
class ArchSpec:
    """An architecture's registry entry: four required fields, the rest optional with a default that
    works (docs/adding-an-architecture.md has the table)."""

    name: str
    config_cls: type  # a dataclass deriving from pretrain.models.base.ModelConfig, with validate()
    build: Callable[[Any], Any]  # config -> nn.Module, built through parallel.layers only
    # Training FLOPs per token at sequence length T for the step of a StepContext (an architecture
    # whose work depends on a per-step draw, like CRT's K, computes that step's); ctx None: the
    # expected value over the draws (what `pretrain info` prints).
    flops_per_token: Callable[..., float]
    # Streaming decode and full-sequence logits; by default the model's own methods (a decoder-shaped
    # model has them: pretrain/models/decoder.py). A model of another shape may pass its own functions.
    new_state: Callable[[Any, int], Any] = _model_new_state  # (model, batch size) -> empty streaming cache
    step: Callable[[Any, Any, Any], tuple[Any, Any]] = _model_step  # (model, tokens [B, n], state) -> (logits, state)
    logits: Callable[[Any, Any], Any] = _model_logits  # (model, tokens [B, T]) -> logits [B, T, V], float32
    flops_formula: str = ""  # flops_per_token in words and symbols, printed by `pretrain info`
    # The parameter count by the paper's own formula where it counts differently from the model (CRT's
    # §3.1 counts matmul weights and the head, not biases and norms); `pretrain info` shows both. None
    # from the default: the paper counts what the model holds.
    formula_params: Callable[[Any], int | None] = lambda cfg: None
    # Lines of its own that `pretrain info` prints for a config (CART's effective parameter count at R)
    info: Callable[[Any], list[str]] = lambda cfg: []
    # The inference settings an evaluation at sequence length T uses, as lines `pretrain eval` prints
    # (CRT's K passes, CART's R): inference_settings(cfg, T) -> [lines].
    inference_settings: Callable[[Any, int], list[str]] = lambda cfg, seq_len: []
    decode: DecodeRelation = DecodeRelation()
    progress: tuple[str, ...] = ()  # diagnostics shown on the progress line (all go to metrics.jsonl)
    supports: Support = Support()
    # model dimensions tensor parallelism splits: {"model.n_heads": 8, ...}; RunConfig.validate refuses a
    # parallel.tp that does not divide each (default: a decoder-shaped config's heads, FFN and vocabulary)
    tp_dims: Callable[[Any], dict[str, int]] = _decoder_tp_dims
    # The planner's activation-memory estimate: activation_bytes(cfg, T, micro_batch, recompute) -> the
    # peak bytes of one micro batch's forward and backward in fp32 (pretrain/plan.py scales it by stage);
    # None from the default: no estimate (the planner shows weights and optimizer state only, "+?")
    activation_bytes: Callable[[Any, int, int, str], int | None] = lambda cfg, seq_len, batch, recompute: None
    # The share of those bytes, the loss's logits aside, a micro batch keeps under bf16 autocast, per recompute
    # policy: bf16_kept(recompute) (pretrain/plan.py's bf16_activations; tests/test_plan.py measures it under
    # CPU autocast); 0.65 by default: the residual stream, norms' inputs and softmax statistics stay fp32
    bf16_kept: Callable[[str], float] = lambda recompute: 0.65
    # A recurrence over positions that training cannot parallelize: serial_loop(cfg, T) -> (dependent
    # steps one micro batch's forward takes, its backward the same; training FLOPs per token run inside
    # those steps, forward and backward). The planner charges each step a latency and runs those FLOPs
    # at a position-serial efficiency (parallel/plan.py). None (the default): every position runs at once.
    serial_loop: Callable[[Any, int], tuple[int, float] | None] = lambda cfg, seq_len: None
    # (hidden width, layers): the planner sizes its matmul efficiency and the activations a tensor- or
    # pipeline-parallel step sends by the width, and counts tensor-parallel all-reduces by the layers.
    # Default: a decoder-shaped config's (model.d_model, model.n_layers).
    plan_shape: Callable[[Any], tuple[int, int]] = lambda cfg: (cfg.d_model, cfg.n_layers)
    # Pipeline stages (parallel/pipeline.py): pipeline_split(cfg, pp) -> pp + 1 boundaries over the
    # model's units (pretrain/models/units.py; ValueError, one sentence, when they do not split). The
    # default refuses; Support.pp is set with a split of its own.
    pipeline_split: Callable[[Any, int], list] = _no_pipeline
    # Activation recompute policies (parallel/recompute.py): {policy name: policy}, the first being the
    # recommended one (`parallel.recompute=full`); a single policy is the one policy "full". A policy is
    # a Recompute: Recompute(wrap=fn), fn: model -> the modules to checkpoint, or Recompute(configure=fn),
    # fn: model -> None, which sets what the model's forward reads to recompute by itself (segments of a
    # time loop, a custom backward); a bare function means Recompute(wrap=fn). A model that applies a
    # block several times per step can offer several (CRT: each block in each pass, or a whole pass
    # keeping only its input). Default: none.
    recompute_units: Recompute | Callable[[Any], list] | dict[str, Recompute | Callable[[Any], list]] = \
        field(default_factory=dict)
    # Loops run as CUDA graphs under train.cuda_graphs (kernels/captured.py): captured_regions(run) ->
    # (what they are in words, for the start line; None with why not in this run, e.g. without the
    # recompute that makes a segment a region). Default: none, (None, None).
    captured_regions: Callable[[Any], tuple[str | None, str | None]] = lambda run: (None, None)
    # The static buffers those regions hold while captured, captured_bytes(model_cfg, seq_len, micro_batch) ->
    # bytes, which the planner adds under train.cuda_graphs on/auto. Default: None (not estimated).
    captured_bytes: Callable[[Any, int, int], int] | None = None
    # Token ids the model uses internally, {name: id} from its config (SPS's <predict>): the trainer
    # refuses a dataset that holds one, and generation never samples one (its logits are left as the
    # model computes them, so the decode relation still compares the model's own). Default: none.
    internal_tokens: Callable[[Any], dict[str, int]] = lambda cfg: {}
    # Export (pretrain/export): the generic native folder works for any model whose state dict is
    # its weights; an architecture that cannot be exported says why here (the round-trip test and
    # `pretrain export` quote it). `hf`: an adapter to and from a Hugging Face transformers layout
    # (pretrain/models/hf_llama.py's LlamaAdapter is the interface), for `--format hf` and import;
    # the default, NoHF, refuses `--format hf` in one sentence.
    export_refusal: str = ""
    hf: Any = NoHF()
    # Tensors as an earlier version of the model saved them, renamed or split into today's:
    # upgrade_state(state, cfg) -> state (full single-device tensors). Export and import apply it, so
    # `pretrain import OLD_RUN NEW_RUN` carries an older run's weights forward. Default: unchanged.
    upgrade_state: Callable[[dict, Any], dict] = lambda state, cfg: state
    # Starting a run from another architecture's weights (checkpoint.init_from):
    # convert(source_arch, source_cfg, source_state, target_cfg) -> this architecture's full,
    # single-device state dict (every name its model's state_dict has, tied weights under each name).
    # Raises ValueError, one sentence, for a source it cannot convert (another width, depth or
    # vocabulary; an unknown source architecture). validate() calls it on meta tensors to check the
    # shapes before any work, so it must only use tensor operations (make new tensors with
    # zeros_like/new_zeros of a source tensor, never read values). The default refuses every source
    # (same-architecture loading only).
    convert: Callable[[str, Any, dict, Any], dict] = _no_conversion
    # The model fields a conversion from `source_arch` fixes beyond those both configs share by name
    # (CRT from a baseline: {"block": "llama"}); `pretrain import --arch` builds the target config
    # from the shared fields, these, then the user's overrides. Default: only the shared fields.
    convert_fields: Callable[[str, Any], dict] = lambda source_arch, source_cfg: {}

    def __post_init__(self):
        units = self.recompute_units
        if isinstance(units, dict):
            policies = {name: as_policy(p) for name, p in units.items()}
            policies = {"full": next(iter(policies.values())), **policies} if policies else {}
        else:
            policies = {"full": as_policy(units)}
        object.__setattr__(self, "_policies", policies)

    def recompute_policies(self) -> dict[str, Recompute]:
        """Every policy by name as a Recompute, "full" included (the first named one, or the single one)."""
        return dict(self._policies)

    def never_sampled(self, model_cfg, eos_id: int | None, pad_id: int | None) -> list[int]:
        """The ids generation never samples: those the architecture uses internally (SPS's <predict>,
        spec-001 §2.6) and padding, unless the pad token doubles as EOS. An exported HF folder suppresses
        the same ids (its generation_config's suppress_tokens), so that both decode alike."""
        never = set(self.internal_tokens(model_cfg).values())
        if pad_id is not None and pad_id != eos_id:
            never.add(pad_id)
        return sorted(never)

    @property
    def converts(self) -> bool:
        """Whether a run may start from another architecture's weights (a `convert` of its own)."""
        return self.convert is not _no_conversion


def count_parameters(model) -> dict[str, int]:
    """total / embedding / non_embedding parameter counts of a model (works on the meta device).

    Shared (tied) tensors count once; the token embedding and an untied output head count as
    embedding. Recognised by their facades' `counts_as_embedding`, so every architecture is counted the same way.
    """
    seen, total, embedding = set(), 0, 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partitioned parameter reports 0 elements
            total += n
            if getattr(module, "counts_as_embedding", False):
                embedding += n
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


def meta_model(model_cfg):
    """The single-device model of `model_cfg` built on the meta device (nothing allocated), whatever
    parallel layout this process has set up: for its names, shapes, tied tensors and parameter counts."""
    import torch

    from parallel.mesh import single_device

    with torch.device("meta"), single_device():
        return get_arch(model_cfg.arch).build(model_cfg)


def weight_shapes(model_cfg) -> dict[str, tuple]:
    """{state-dict name: shape} of the single-device model of `model_cfg`."""
    return {k: tuple(v.shape) for k, v in meta_model(model_cfg).state_dict().items()}


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    from pretrain.models.base import ModelConfig

    if not (isinstance(spec.config_cls, type) and issubclass(spec.config_cls, ModelConfig)):
        raise TypeError(f"architecture {spec.name!r}: its config class must derive from "
                        "pretrain.models.base.ModelConfig")
    if spec.supports.pp != (spec.pipeline_split is not _no_pipeline):
        raise ValueError(f"architecture {spec.name!r}: Support.pp and pipeline_split go together")
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"architecture {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def get_arch(name: str) -> ArchSpec:
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"model.arch {name!r} is not a known architecture; known: {', '.join(sorted(_REGISTRY))}") from None


def all_archs() -> list[ArchSpec]:
    _discover()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


_DISCOVERED = False


def _discover() -> None:
    """Import every module of this package and of the `pretrain.architectures` entry points (each
    registers itself); once, and lazily, so `pretrain --help` stays fast."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True  # before the imports: a model module may itself ask the registry
    try:
        package = importlib.import_module("pretrain.models")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"pretrain.models.{module.name}")
        from importlib.metadata import entry_points

        for entry in entry_points(group="pretrain.architectures"):
            entry.load()
    except BaseException:
        _DISCOVERED = False
        raise
