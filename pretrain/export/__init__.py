"""Models leaving and entering the training stack: self-contained exported folders (every
architecture, loadable with torch and safetensors only), the Hugging Face layout of architectures
whose registry entry has an `hf` adapter, and imports of such folders (or runs) as runs to fine-tune.

    pretrain/export/writer.py      `pretrain export`: the folder, its config, tokenizer, model card
    pretrain/export/loader.py      load_folder(): the standalone loader (eval/generate use it too)
    pretrain/export/importer.py    `pretrain import`: HF folder / exported folder / run -> a run directory
    pretrain/export/source.py      reading a checkpoint as full tensors; folders written atomically
    pretrain/export/tensorfile.py  safetensors written one tensor at a time
"""


def load_folder(*args, **kwargs):
    """pretrain.export.loader.load_folder (imported lazily: this package's import stays light)."""
    from pretrain.export.loader import load_folder as load

    return load(*args, **kwargs)
