"""Request validation before anything reaches Triton (derived per model from its metadata and config)."""
