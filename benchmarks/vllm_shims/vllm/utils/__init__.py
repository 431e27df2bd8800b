"""Stand-ins for the two `vllm.utils` submodules the LoRA ops import."""
