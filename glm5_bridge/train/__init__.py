"""Trainers: LoRA SFT and LoRA RL on Megatron, driven by recipes (recipe.py)."""
