"""The model runner and what runs beside it: input batch, TP worker, CUDA graphs, the C++ decode
loop, profiling and KV cache sizing."""
