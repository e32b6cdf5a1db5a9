"""Datasets (synthetic, text), the data-parallel batch sampler, and the LightningDataModule."""
