"""`next_power_of_2` as in vLLM's `vllm/utils/math_utils.py`."""


def next_power_of_2(n: int) -> int:
    """The next power of 2 (inclusive)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()
