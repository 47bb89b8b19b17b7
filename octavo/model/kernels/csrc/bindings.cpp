#include <torch/python.h>

#include "ops.h"

void bind_decode_stack(py::module& m);  // decode_stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention, single-token decode (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("first_pos") = py::none(),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("paged_prefill", &paged_prefill,
        "paged attention for every prefill chunk of a step in one call (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("start_pos"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("bf16_dot") = true, py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("kv_write", &kv_write,
        "the step's K/V into int8 or fp8 KV caches at the slot mapping, quantized per token",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("prefill_bf16_dot", &prefill_bf16_dot,
        "whether paged_prefill computes bf16 with the CPU's bf16 dot products");
  m.def("isa", &compiled_isa, "the instruction set this build's kernels use");
  m.def("rms_norm", &rms_norm, "RMSNorm in transformers' op order");
  m.def("add_rms_norm_", &add_rms_norm_,
        "residual += x (in place), then RMSNorm(residual)");
  m.def("rope_", &rope_, "rotary embedding of the q and k heads of a fused qkv buffer, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up from a fused [T, 2I] gate_up buffer");
  m.def("gated_delta_step", &gated_delta_step,
        "one Gated DeltaNet decode step of a batch, each state updated in place in its slot",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
        py::arg("state"), py::arg("slots"), py::arg("out"));
  m.def("ssd_step", &ssd_step,
        "one Mamba-2 decode step of a batch, each state updated in place in its slot",
        py::arg("x"), py::arg("dt"), py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"),
        py::arg("state"), py::arg("slots"), py::arg("out"));
  m.def("quantize_rows_int8", &quantize_rows_int8,
        "per-row symmetric int8 quantization: (q, scale)", py::arg("x"), py::arg("qmax"));
  m.def("int8_epilogue", &int8_epilogue, "int32 GEMM sums * x_scale * w_scale (+ bias)",
        py::arg("acc"), py::arg("x_scale"), py::arg("w_scale"), py::arg("bias"),
        py::arg("dtype"));
  m.def("block_linear", &block_linear,
        "x @ W^T (+ bias) with W in 4-bit or 8-bit blocks, widened in registers",
        py::arg("x"), py::arg("kind"), py::arg("q"), py::arg("scale"), py::arg("mins"),
        py::arg("group"), py::arg("bias"), py::arg("int8_activations") = false);
  m.def("block_int8_tiles", &block_int8_tiles,
        "whether block_linear takes prefill-sized batches on int8 activations in integer tiles");
  m.def("block_tiles_path", &block_tiles_path,
        "the integer tiles block_linear takes here: avx512_vnni, avx2 or none");
  m.def("block_tiles_set_vnni", &block_tiles_set_vnni,
        "AVX-512 build: allow its VNNI tiles (else the AVX2 ones); returns the previous setting",
        py::arg("enabled"));
  m.def("block_dequantize", &block_dequantize, "rows of a block-quantized weight as float32",
        py::arg("kind"), py::arg("q"), py::arg("scale"), py::arg("mins"), py::arg("group"),
        py::arg("row_begin"), py::arg("row_end"), py::arg("out") = py::none());
  m.def("kquant_linear", &kquant_linear,
        "x @ W^T (+ bias) with W in GGUF K-quant super-blocks (int8 activations)", py::arg("x"),
        py::arg("kind"), py::arg("q"), py::arg("bias"));
  m.def("kquant_dequantize", &kquant_dequantize, "rows of a K-quant weight as float32",
        py::arg("kind"), py::arg("q"), py::arg("row_begin"), py::arg("row_end"),
        py::arg("out") = py::none());
  m.def("kquant_quantize_x", &kquant_quantize_x,
        "activations as kquant_linear quantizes them: (q, d, sums of 16)", py::arg("x"));
  m.def("kquant_repack", &kquant_repack,
        "K-quant super-blocks from the file's layout to kquant_linear's", py::arg("kind"),
        py::arg("raw"));
  m.def("kquant_kernel", &kquant_kernel, "kquant_linear's path on this build and CPU");
  m.def("kquant_has_amx", &kquant_has_amx, "whether kquant_linear can take AMX tiles here");
  m.def("kquant_set_amx", &kquant_set_amx,
        "let kquant_linear take AMX tiles (the default) or not; returns the previous setting",
        py::arg("enabled"));
  m.def("int8_gemv", &int8_gemv, "exact int32 xq . wq^T for a few rows (W8A8 decode)",
        py::arg("xq"), py::arg("wq"));
  m.def("int8_mm", &int8_mm, "exact int32 xq . wq^T: int8_gemv for a few rows, else oneDNN",
        py::arg("xq"), py::arg("wq"));
  m.attr("INT8_GEMV_ROWS") = kInt8GemvRows;
  m.def("int8_linear", &int8_linear,
        "a W8A8 linear layer: quantize_rows_int8, int8_mm, int8_epilogue", py::arg("x"),
        py::arg("wq"), py::arg("w_scale"), py::arg("bias"));
  m.def("packed_gemv", &packed_gemv,
        "x @ W^T (+ bias) for 1-64 rows, W read in place from oneDNN's packed layout",
        py::arg("x"), py::arg("weight_ptr"), py::arg("n"), py::arg("k_padded"), py::arg("bias"),
        py::arg("block"));
  m.def("packed_gemv_max_rows", &packed_gemv_max_rows,
        "the most rows of this dtype, in blocks of `block` outputs, a model's layer gives "
        "packed_gemv here (0: none)",
        py::arg("dtype"), py::arg("block") = 64);
  m.def("packed_gemv_supports", &packed_gemv_supports,
        "whether packed_gemv computes this dtype on this build and CPU", py::arg("dtype"));
  m.def("packed_gemv_has_amx", &packed_gemv_has_amx,
        "whether packed_gemv computes bf16 in oneDNN's AMX layout with AMX tiles here");
  m.def("packed_gemv_set_amx", &packed_gemv_set_amx,
        "let packed_gemv use AMX where it can (default) or not; returns the previous setting",
        py::arg("enabled"));
  bind_decode_stack(m);
}
