"""Engine backends: native/ (pure torch), sglang/ (GPU), megatron/ (training). Each is the only home
of its heavy imports."""
