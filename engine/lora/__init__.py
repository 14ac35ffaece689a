"""Multi-LoRA serving (docs/engine/parallel-and-lora.md): adapter configs and weights, device slots, the per-step delta."""
