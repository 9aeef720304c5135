"""tp_llama's own C kernels for x86 CPUs: api.h is their interface, build.py builds them, ffi.py
loads them, ops.py runs them on tensors."""
