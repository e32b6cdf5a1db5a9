"""The memory plan: what each rank of a run will hold, computed before anything starts.

``model.py`` describes a model as parameter shapes, FSDP units and activation sizes (analytically
for the built-in Llama, from a meta-device build for any other ``nn.Module``); ``memory.py`` lays
that out over a run's strategy and mesh, rank by rank; ``check.py`` answers "does it fit?" for
fsdp-train and sweeps; ``cli.py`` is ``fsdp-plan``; ``search.py`` tries candidate layouts.
"""
