"""Adapters (LoRA) over any model fsdp-train builds: the options (torch-free), which layers they
wrap, applying them with Hugging Face ``peft`` before the model is parallelized, and reading them
back out of a checkpoint in PEFT's own format."""
