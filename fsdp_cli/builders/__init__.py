"""Builders: typed config in, Lightning/torch objects out; one module per concern, no Hydra."""
