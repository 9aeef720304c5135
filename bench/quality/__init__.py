"""Perplexity on real weights (issue 46): the texts and their llama.cpp token ids, llama.cpp's own
quantizations scored by llama-perplexity. Our engine scores the same ids with tp_llama.cli.perplexity."""
