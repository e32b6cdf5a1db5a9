"""Models: the built-in Llama-style decoder (with its tensor-parallel plan), the LightningModule
that trains any ``nn.Module`` as a causal LM, and the layout-independent weight init."""
