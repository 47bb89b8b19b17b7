"""Weight formats: int8 and int4 quantization at load, GGUF blocks, GGUF conversion."""
