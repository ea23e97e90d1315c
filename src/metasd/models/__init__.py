"""Models as users have them: loading (hub id, directory, GGUF), the embedded default, int8 drafter weights and the
target's calibrated linear kernels."""

from .loading import DEVICES, DTYPES, EMBEDDED, LoadedModel, load_model, load_tokenizer, resolve_device, same_tokenizer

__all__ = [
    "DEVICES",
    "DTYPES",
    "EMBEDDED",
    "LoadedModel",
    "load_model",
    "load_tokenizer",
    "resolve_device",
    "same_tokenizer",
]
