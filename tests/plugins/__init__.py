"""Techniques defined outside infer_tune/, registered by a test alone (the registry is the only list)."""
