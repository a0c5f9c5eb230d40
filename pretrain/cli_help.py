"""The long help texts of `pretrain` (pretrain/cli.py): examples and the rules each verb states."""

_INFO_HELP = """examples:
  pretrain info baseline/xs
  pretrain info configs/baseline/tiny.yaml model.n_layers=8 --json

Parameters are counted on the meta device (nothing is allocated): shared (tied) tensors count once;
the token embedding and an untied output head count as embedding.
flops_per_token is training FLOPs per token at data.seq_len T from the architecture's own formula
(printed with it; for an architecture whose work is drawn per step, the expected value)."""

_PLAN_HELP = """examples:
  pretrain plan sps/xl --gpus 64                          # the fastest layout of 64 H100s that fits
  pretrain plan baseline/xl --gpus 256 --gpu a100 --gpu-memory 40
  pretrain plan sps/l --dry-run --layout tp=4,pp=2,dp=8   # build and shape-check one layout, no GPU

--dry-run: each pipeline stage is built as one of its ranks would build it (tensor-parallel shards,
its units), on the meta device and torch's fake process group, and one micro batch's forward and
backward run on meta tensors: a layout whose shapes do not fit fails here, in seconds.

Bytes per rank (fp32 parameters, AdamW), by parallel.data_parallel:
  ddp / megatron:           weights 4n, gradients 4n, optimizer 8n + 4k   (k tensors: AdamW's step)
  megatron distributed opt: weights 4n, gradients 4n, optimizer 8n/dp
  ZeRO-1 / 2 / 3:           optimizer 12n/dp; ZeRO-2 also gradients 4n/dp; ZeRO-3 also weights 4n/dp
with n the rank's parameters (1/tp of a split matrix, its stage's units). Activations: the
architecture's activation_bytes (per micro batch at its recompute policy) x the stage's share of the
units / tp x the micro batches 1F1B keeps in flight on it (pp - stage; interleaved with v stages per rank:
((pp - stage - 1) x 2 + (v - 1) x pp + 1) / v, megatron's warm-up), halved under bf16; under
train.cuda_graphs auto or on, the static buffers of the captured loops (RT's: 6 fp32 [b, T, d]; GPN's under
parallel.recompute=full: its state 5 times, its loop's matrices 3 times, 5 [b, n, d] per segment length n;
none under pipeline stages); 2 GiB reserved.

--gpus N: every tp (dividing the GPUs, at most a node's 8) x pp x dp layout, engine, recompute policy
and micro batch the config validates under, with (F the architecture's FLOPs per token, M micro
batches per step and stage, b T d a micro batch's activations):
  compute = (F - Fs + Fs / kappa) x tokens per step / GPUs / (peak x eta), x 4/3 with recompute;
            eta = eta_max x w / (w + 256), w = d / tp (eta_max per GPU, calibrated: docs/planner.md);
            + M x S/pp x 2 passes (3 with recompute) x step_s for an architecture whose registry
            serial_loop runs S dependent position steps per micro batch holding Fs FLOPs per token
            (RT, GPN); step_s ~ 55 us and kappa ~ 0.23 are fitted to RT's published layer latencies
  bubble  = compute x (pp - 1) / (v M), v = parallel.virtual_stages (tried as 1 and, where the split and
            M allow it, 2: the vp column)
  tp comm = M x L/pp x 4 all-reduces (6 with recompute) of b T d bf16, ring 2 (tp-1)/tp, NVLink
  pp comm = v x M x 2 sends of b T d bf16 per stage (NVLink in a node, else the network)
  dp comm = 2 (dp-1)/dp x 4n bytes (NVLink when tp x dp fit a node, else the network; x2 for ZeRO-3),
            half hidden behind the backward, none under pipeline stages
  MFU     = F x tokens/s per GPU / peak
The table lists the candidates, fastest first among those that fit, and proposes the first."""

_RUN_PATHS = """A run's paths are stored absolute; one that no longer exists is looked up at the same place
relative to the run directory (a run moved together with its data works), and the tokenizer falls
back to the run's own copy. A corrupt checkpoint (a file failing its checksum) is named; with a run
directory the previous checkpoint is used instead, with a line saying so."""

_TRAIN_HELP = """examples:
  pretrain train baseline/tiny                                   # a shipped config, by short name
  pretrain train configs/baseline/tiny.yaml optim.lr=1e-3 train.max_steps=500
  pretrain train baseline/xs data.train=[data/web_text_document] train.name=xs-web
  pretrain train runs/xs-web train.max_steps=20000               # resume a run directory, from anywhere
  pretrain train baseline/xs checkpoint.init_from=runs/xs-web train.name=xs-ft optim.lr=1e-4   # fine-tune

Overrides are dotted `section.key=value` (sections: model, parallel, data, optim, schedule, train,
checkpoint, log); an unknown key or a wrong type is an error. The run directory (train.run_dir,
default runs/<train.name>) receives config.yaml, metrics.jsonl, the tokenizer and checkpoints/; a
run started again with the same run directory resumes from its latest checkpoint
(checkpoint.resume=false starts over). Given a run directory as CONFIG, its stored config is used
and the run resumes where it is, even after being moved.

checkpoint.init_from=PATH (a run directory: its latest verified checkpoint; or a checkpoint
directory) starts a run that has no checkpoint of its own from those model weights, with a fresh
optimizer, step 0 and a fresh data order. Another model.arch is converted by the run's architecture
(its registry `convert`; without one it is refused). Shapes and the conversion are checked before
any work; once the run has its own checkpoint, it resumes that and init_from is not read.

Ctrl-C finishes the current step on every rank, writes a checkpoint and exits (130); a second
Ctrl-C stops at once, keeping the latest checkpoint. train.stop_signals (default SIGTERM, SIGUSR1:
what Slurm sends before a time limit or a preemption) do the same and exit 75 for a requeue.
`kill -USR2 PID` prints every thread's Python stack to stderr and the run goes on: where a hang or a
long compile is. PRETRAIN_STACKS_EVERY=S prints them every S seconds until the first step is logged (a
first step that compiles for minutes, sampled; the GPU suite sets 20). PRETRAIN_MEMORY_TRACE=N (CUDA)
records the memory allocator until step N ends, writes RUN_DIR/memory_trace.pickle (pytorch.org/memory_viz
draws it) and logs the peak and what was alive then, by the line of code that allocated it.

A step whose loss or grad norm is not finite stops the run (train.nan_policy=stop) or is skipped
without touching the optimizer (train.nan_policy=skip); more than train.max_bad_steps (default 5)
skips in a row stop it, naming the steps and their data. train.skip_outlier_z=Z (> 0; default null = off)
also skips a loss or grad norm more than Z std above its mean over the last
train.skip_outlier_window steps.

On a GPU: train.compile (default on) compiles the model (RT: its read-out alone; its layers' position
loops would unroll). train.compile_scope=blocks compiles each block apart instead (blocks alike share
one graph: compiling takes about one block's time). train.cuda_graphs=auto|on|off (default off; auto
in RT's and GPN's paper configs) replays RT's layers and GPN's BPTT segments as CUDA graphs, eager
elsewhere with one line saying so (on: refused where it cannot run); docs/kernels.md, "Captured regions".

""" + _RUN_PATHS


_INFERENCE_OVERRIDES = ("dotted overrides of the stored config for what may change after training: data.* (e.g. "
                        "data.valid=[PREFIX], data.tokenizer=PATH), train.eval_batches, train.micro_batch_seqs, "
                        "checkpoint.verify, model fields that keep every weight's shape, and the runtime settings "
                        "train.threads, train.device (auto, cpu, cuda; default cpu) and train.compile (default off)")


_EXPORT_HELP = """examples:
  pretrain export runs/xs-web exports/xs-web                    # native folder, any architecture
  pretrain export runs/xs-web exports/xs-web-hf --format hf     # transformers.LlamaForCausalLM (baseline)
  pretrain export runs/sps-s exports/sps-s-hf --format hf       # AutoModelForCausalLM, trust_remote_code=True
  pretrain export runs/xs-web/checkpoints/step_00002000 exports/xs-2000 --dtype bfloat16

The folder holds model.safetensors (the single-device model's tensors, by name), config.json (the
model config and architecture), the tokenizer, generation_config.json and a README.md model card
(parameters, training tokens, final validation loss, this command). Checkpoints of any layout (TP,
ZeRO-3, the distributed optimizer, one process) export alike. `pretrain eval` and `pretrain
generate` take the folder in place of a run; in Python, with torch and safetensors only:
  from pretrain.export import load_folder; model, spec, cfg, tokenizer = load_folder("exports/xs-web")
An existing OUT is refused unless --force (it is replaced only once the new folder is complete).

""" + _RUN_PATHS

_IMPORT_HELP = """examples:
  pretrain import ~/llama-hf runs/llama                         # a local HF Llama folder -> a baseline run
  pretrain import ~/llama-hf runs/llama-crt --arch crt model.k_max=5 model.k_min=2   # ... -> a CRT
  pretrain import runs/xs-web runs/xs-crt --arch crt            # a trained baseline run -> a CRT
then fine-tune in a new run that starts from the imported weights (fresh optimizer, step 0):
  pretrain train runs/llama train.run_dir=runs/llama-ft checkpoint.init_from=runs/llama data.train=[PREFIX]

SOURCE: a local Hugging Face folder (config.json + model.safetensors or a sharded index; Llama
only: model_type llama without biases, sliding windows or RoPE scaling), a folder from `pretrain
export`, or a run or checkpoint directory. Nothing is downloaded. --arch converts through that
architecture's registry `convert` (CRT: function-preserving, the correction's output layer at zero,
so the converted model's logits equal the source's for every K until fine-tuning). Overrides set
any field of OUT_RUN's config (model.* of the target, data.*, train.*, ...). The tokenizer is the
folder's tokenizer.json or tokenizer.model unless --tokenizer names one; a tokenizer with more
tokens than the model's vocabulary is refused."""
