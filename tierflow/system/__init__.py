"""system layer."""
