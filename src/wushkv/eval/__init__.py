"""Evaluations: perplexity, layer reconstruction, generation agreement, long context."""
