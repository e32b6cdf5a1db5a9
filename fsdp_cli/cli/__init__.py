"""The parent process: Hydra composes the config (``main``), its errors become one line
(``hydra_errors``), and a sweep ends with a comparison table (``sweep``). The only package
besides ``config.store`` that imports Hydra; nothing here imports torch before launching.
"""
