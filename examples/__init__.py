"""Examples of mc: the demo trainer (``python -m examples.train_gpt`` under torchrun) and
``show_groups.py``. The small GPT in :mod:`examples.gpt` is shared with ``integration_tests``.
"""
