"""EAGLE3 training by self-distillation: the target answers prompts (distill.py), the draft
learns to predict the target's next tokens from its features (trainer.py)."""
