"""The seams to the hardware: CUDA (capture, copies, sync) and NVML."""
