"""Where models come from: the catalog of known models (pulled and verified into the local cache) and GGUF
files from the Hugging Face Hub."""
