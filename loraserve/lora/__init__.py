"""LoRA wrappers for the base model's target modules, fed by one per-step `LoRAState`."""
