"""Working on model files rather than running them: quantize, convert, perplexity, bench, info, warmup, and the
CLI's flags for quantize, convert and perplexity."""
