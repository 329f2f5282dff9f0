"""Weights kept in GGUF's quantized types and multiplied as stored (issue 57).

- kernels.py: the C++ kernels (csrc/quant_linear.cpp), built per source and flags like the others;
- reference.py: their torch reference, the gguf package's dequantizer + a torch matmul;
- linear.py: QuantizedLinear and QuantizedEmbedding, the model's modules over raw blocks.

The kernels run on the CPU; a weight whose type has none, or a model on another device, is
dequantized at load as before (engine/execution/gguf_weights.py says which, in the log).
"""
