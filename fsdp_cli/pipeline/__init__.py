"""Pipeline parallelism: a model cut into stages, driven by torch's schedules.

Torch-free here (options, the schedules' facts, where a model is cut) so the parent can check a
pipeline layout before any process starts; the modules that build stages import torch.
"""
