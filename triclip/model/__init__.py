"""Models: pretrained towers, the dual encoder, unlocking, the fast CPU paths, batch embedding, caches, run folders, shards."""
