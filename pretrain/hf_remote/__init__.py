"""Every architecture as Hugging Face remote code: the generator (bundle.py, generate.py), the one-device
pieces it substitutes (single_device.py), the transformers wrapper it appends (hf_model.py), the registry
adapter (adapter.py) and the generated files (shipped/). docs/hf-remote.md explains them."""
