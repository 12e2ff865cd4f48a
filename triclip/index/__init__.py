"""triclip index."""
