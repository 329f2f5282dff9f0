"""Weights kept in GGUF's quantized types and multiplied as stored (issue 57).

- kernels.py: the C++ kernels (csrc/quant_linear.cpp), built per source and flags like the others;
- triton_linear.py: the Triton kernels, the same types on a CUDA device;
- reference.py: their torch reference, the gguf package's dequantizer + a torch matmul;
- linear.py: QuantizedLinear and QuantizedEmbedding, the model's modules over raw blocks.

The C++ kernels run on the CPU, the Triton ones on CUDA (the loader picks by device and logs which);
a weight whose type has none, or a model on another device, is dequantized at load as before
(engine/execution/quant/gguf_tensors.py says which, in the log).
"""
