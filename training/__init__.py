"""triclip training."""
