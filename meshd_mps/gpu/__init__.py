"""The GPU seen without a context: device queries, NVRTC and nvJitLink."""
