"""Multi-LoRA serving (docs/architecture.md §4, LoRA): adapter configs and weights, device slots, the per-step delta."""
