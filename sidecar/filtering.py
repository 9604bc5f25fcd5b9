"""Output filtering: outputs that never leave the pod."""
