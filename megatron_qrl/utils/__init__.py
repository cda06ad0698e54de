"""Small shared helpers (optional imports, atomic writes)."""
