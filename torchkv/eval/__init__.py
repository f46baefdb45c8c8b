"""Evaluation: perplexity through the compressed cache, retrieval, memory and speed, reports."""
