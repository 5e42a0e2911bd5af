"""Integrations with training frameworks. Each lives in its own module and
imports its framework only when imported itself:

    from zero.integrations.hf import ZeroTrainer   # HuggingFace transformers
    from zero.integrations.trl import ZeroDPOTrainer, ZeroGRPOTrainer   # TRL
"""
