"""``fsdp-generate``: answers from a trained model, on one process (CPU or one GPU).

:mod:`~fsdp_cli.generate.source` opens what a run left (a checkpoint, a run folder, an exported
Hugging Face or PEFT folder) as a model, its tokenizer and chat template;
:mod:`~fsdp_cli.generate.decode` generates (transformers' ``generate`` for ``model=hf``, a
key/value-cached loop for the built-in decoder). Prompt files are read and rendered as the run's
data was by :mod:`fsdp_cli.data.prompts` (shared with ``trainer.sample_prompts``).
"""
