"""Compact features and metrics: the importance order, top-m embeddings, baseline orderings, recall and mAP."""
