"""Encoder cache: encoder outputs (e.g. image embeddings) stored by content identifier."""
