"""`LoRARequest`: which adapter a generation request wants, named the way vLLM names it."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

__all__ = ["LoRARequest", "validate_adapter_name"]

MAX_NAME_LENGTH = 256


def validate_adapter_name(name: object) -> str:
    """Return ``name`` if it is safe to use as an adapter name, else raise ``ValueError``.

    Names may hold ``/`` (``org/repo/subdir`` on the Hub) but never a ``..`` segment, a leading
    ``/`` or ``\\``, a drive letter or a control character: a name is joined to resolver roots
    and URLs, and must not be able to step outside them.
    """
    if not isinstance(name, str):
        raise ValueError(f"adapter name must be a string, got {type(name).__name__}")
    if not name or not name.strip():
        raise ValueError("adapter name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"adapter name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}")
    if any(unicodedata.category(char) in ("Cc", "Cf") for char in name):
        raise ValueError(f"adapter name {name!r} contains a control character")
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ValueError(f"adapter name {name!r} must be relative (no leading '/', '\\' or drive)")
    segments = name.replace("\\", "/").split("/")
    if any(segment in ("..", ".") for segment in segments):
        raise ValueError(f"adapter name {name!r} must not contain '.' or '..' path segments")
    return name


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A request for one LoRA adapter.

    :param lora_name: the adapter's name, unique per server; resolvers look it up by this name.
    :param lora_int_id: a positive integer naming the adapter in the engine; 0 means "no adapter".
        Two requests are equal when their ids are equal.
    :param lora_path: a local directory or a URI (``s3://…``, ``hf://…``); empty means "find it
        by name through the resolvers".
    :param base_model_name: the base model the adapter was trained for; checked when given.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        validate_adapter_name(self.lora_name)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be a positive int (0 is reserved for 'no adapter'), "
                f"got {self.lora_int_id}"
            )
        if not isinstance(self.lora_path, str):
            object.__setattr__(self, "lora_path", str(self.lora_path))  # accept pathlib.Path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_int_id == self.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)
