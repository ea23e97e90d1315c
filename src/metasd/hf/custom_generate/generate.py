"""transformers' custom generation method for metasd: `model.generate(**inputs, trust_remote_code=True,
custom_generate=metasd.hf.CUSTOM_GENERATE)` calls this `generate` with the model and every argument generate got."""

from metasd.hf.drop_in import generate as _metasd_generate


def generate(model, **kwargs):
    """generate's arguments (with `inputs` for its first positional one), decoded by `metasd.hf.generate`; the
    arguments generate passes as None (no streamer, no custom processors...) mean "not used"."""
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    return _metasd_generate(model, **kwargs)
