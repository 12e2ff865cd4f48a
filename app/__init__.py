"""triclip app."""
