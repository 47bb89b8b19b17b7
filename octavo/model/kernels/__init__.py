"""ISA detection, octavo's compiled C++ ops (csrc/) and its Triton kernels (triton/)."""
