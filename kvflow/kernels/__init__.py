"""Block-id KV transfer kernels (PyCUDA) with a torch CPU reference."""
