"""The decode loop's parts: options, sampling, stop strings and UTF-8-safe text, constrained decoding, one
sequence's steps, batched generation, results and saved session state. The Model (edgellm/api.py) drives them."""
