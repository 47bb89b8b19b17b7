"""POST /v1/completions, and the /tokenize and /detokenize endpoints."""
