"""For transformers users: `metasd.hf.generate(model, **inputs, ...)` in place of `model.generate(**inputs, ...)`,
and `CUSTOM_GENERATE`, a local custom generation method: `model.generate(**inputs, custom_generate=CUSTOM_GENERATE,
trust_remote_code=True)` decodes through metasd (transformers loads `custom_generate/generate.py` from it)."""

from pathlib import Path

from .drop_in import MetasdGenerateOutput, decoder_for, generate

CUSTOM_GENERATE = str(Path(__file__).resolve().parent)

__all__ = ["CUSTOM_GENERATE", "MetasdGenerateOutput", "decoder_for", "generate"]
