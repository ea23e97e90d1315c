"""An EAGLE draft head (Li et al., "EAGLE", arXiv 2401.15077) and the directory it is saved as.

The head is a decoder layer (or a few: `HeadConfig.decoder_layers`) that reads, for position i, the target's feature f_i
(the output of its final norm) fused with the embedding of token i + 1, and predicts f_(i+1); the target's own LM
head, restricted to a draft vocabulary (the most frequent target tokens, as EAGLE-3, arXiv 2503.01840, reduces it),
reads the prediction out as the next token's logits. Drafting feeds the head its own predicted features for the
tokens it drafted. With `feature_layers` (EAGLE-3's fused features) a true f_i also holds those decoder layers'
outputs, each scaled to unit RMS (a middle layer's residual stream reaches 10^4 on attention-sink tokens) and
reduced to one vector by a linear layer that starts as "take the final norm's output". A deeper head can grow from
a trained one (`grown`): its new layers start as the identity, so it drafts as the head it grew from until
training moves them.

The embedding and LM head are the target's (not stored): a head directory holds `head.safetensors` (the fusion
layer, the decoder layers, the draft vocabulary) and `config.json` (shape, training facts, and what identifies the
target: architecture sizes and a sample of its embedding, so a head is refused on another model).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaModel

FORMAT = "metasd-eagle-head"
VERSION = 1
_SAMPLE = (8, 8)  # rows x columns of the target's embedding stored as its fingerprint


@dataclass(frozen=True)
class HeadConfig:
    """An EAGLE head's shape: the target's width and attention layout, its draft vocabulary size, the decoder
    layers whose outputs it fuses (EAGLE-3) and how many decoder layers of its own it has (EAGLE's is one)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...] = ()  # decoder layers read beside the final norm (EAGLE-3's fused features)
    decoder_layers: int = 1  # the head's own (EAGLE's head has one)


@dataclass
class TargetCheck:
    """What a head must match in its target: sizes, and a corner of its input embedding (to 1e-2)."""

    model_type: str
    hidden_size: int
    vocab_size: int
    embed_sample: list[list[float]] = field(default_factory=list)

    @classmethod
    def of(cls, model: torch.nn.Module) -> TargetCheck:
        """The check of `model`: its type, sizes and a sample of its input embeddings."""
        embed = model.get_input_embeddings().weight
        rows, cols = _SAMPLE
        return cls(
            model_type=str(model.config.model_type),
            hidden_size=int(model.config.hidden_size),
            vocab_size=int(embed.shape[0]),
            embed_sample=embed[:rows, :cols].float().tolist(),
        )

    def mismatch(self, other: TargetCheck) -> str | None:
        """What differs between the model a head was trained for and `other` (None: the same model)."""
        for name in ("model_type", "hidden_size", "vocab_size"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
        if not torch.allclose(torch.tensor(self.embed_sample), torch.tensor(other.embed_sample), atol=1e-2):
            return "its embedding weights differ (another model of the same shape)"
        return None


def head_config_for(
    model: torch.nn.Module, draft_vocab_size: int, feature_layers: tuple[int, ...] = (), decoder_layers: int = 1
) -> HeadConfig:
    """A head of `decoder_layers` decoder layers shaped like the target's."""
    if decoder_layers < 1:
        raise ValueError(f"a head has at least one decoder layer, got {decoder_layers}")
    c = model.config
    return HeadConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(getattr(c, "rope_theta", None) or (c.rope_parameters or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=c.max_position_embeddings,
        draft_vocab_size=draft_vocab_size,
        feature_layers=tuple(sorted(set(feature_layers))),  # the order targets keep them in
        decoder_layers=decoder_layers,
    )


class EagleHead(torch.nn.Module):
    """An EAGLE head (Li et al., arXiv 2401.15077): decoder layers (EAGLE's one, or more) over (feature of position
    i, embedding of token i + 1) predicting the feature of position i + 1; with fused features, EAGLE-3's fusion of
    several layers' outputs first."""

    def __init__(self, config: HeadConfig, draft_vocab: torch.Tensor):
        super().__init__()
        if draft_vocab.shape != (config.draft_vocab_size,):
            raise ValueError(
                f"draft vocabulary of {tuple(draft_vocab.shape)} ids, config says {config.draft_vocab_size}"
            )
        self.config = config
        d = config.hidden_size
        layers = len(config.feature_layers)
        self.reduce = torch.nn.Linear((layers + 1) * d, d, bias=False) if layers else None
        if self.reduce is not None:  # starts as a head without fused features; training learns what to add
            with torch.no_grad():
                self.reduce.weight.zero_()
                self.reduce.weight[:, layers * d :] = torch.eye(d)
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        body = LlamaConfig(
            vocab_size=1,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            hidden_size=d,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.decoder_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=config.rope_theta,
            max_position_embeddings=config.max_position_embeddings,
            attn_implementation="sdpa",
        )
        self.body = LlamaModel(body)
        self.body.embed_tokens = None  # the head reads fused features, never ids
        self.register_buffer("draft_vocab", draft_vocab.long())

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., d * (len(feature_layers) + 1)] as the one vector [..., d] `forward` reads
        (unchanged without feature layers); the head's own predictions are read as they are."""
        if self.reduce is None:
            return features
        d = self.config.hidden_size
        layers, final = features[..., :-d].unflatten(-1, (-1, d)), features[..., -d:]
        layers = layers * torch.rsqrt(layers.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.reduce(torch.cat([layers.flatten(-2), final], dim=-1))

    def forward(
        self,
        features: torch.Tensor,
        embeds: torch.Tensor,
        cache=None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """features [B, n, d] (f_i) and embeds [B, n, d] (token i + 1) -> predicted features [B, n, d] (f_(i+1));
        causal over the cache and the new entries unless a 4D additive attention_mask says otherwise."""
        fused = self.fc(torch.cat([features, embeds.to(features.dtype)], dim=-1))
        return self.body(
            inputs_embeds=fused,
            cache=cache,
            use_cache=cache is not None,
            position_ids=position_ids,
            attention_mask=attention_mask,
        ).last_hidden_state


def grown(head: EagleHead, decoder_layers: int) -> EagleHead:
    """A copy of `head` with `decoder_layers` decoder layers, the new ones after its own and each the identity
    (their attention's and MLP's output projections zero: a residual layer adding nothing), so it computes exactly
    what `head` computes until training moves them; gradients reach the new layers through those projections. The
    global random state is left as it was (a training's noise draws what it drew without growing)."""
    had = head.config.decoder_layers
    if decoder_layers < had:
        raise ValueError(f"a head of {had} decoder layers cannot grow to {decoder_layers}")
    if decoder_layers == had:
        return copy.deepcopy(head)
    with torch.random.fork_rng(devices=[]):
        deeper = EagleHead(replace(head.config, decoder_layers=decoder_layers), head.draft_vocab.clone())
    missing, unexpected = deeper.load_state_dict(head.state_dict(), strict=False)
    new = tuple(f"body.layers.{i}." for i in range(had, decoder_layers))
    if unexpected or any(not name.startswith(new) for name in missing):
        raise ValueError(f"cannot grow this head: unexpected {unexpected}, missing {missing}")
    with torch.no_grad():
        for layer in deeper.body.layers[had:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    param = next(head.parameters())
    return deeper.to(device=param.device, dtype=param.dtype).train(head.training)


@dataclass
class SavedHead:
    """A head read from its directory: the head, the target it was trained for, that target's check, and its
    training record."""

    head: EagleHead
    target: str  # the spec it was trained for (informative; the check decides)
    check: TargetCheck
    training: dict


def save_head(path: Path, head: EagleHead, target: str, check: TargetCheck, training: dict) -> None:
    """Write the head directory: weights in float16 (half the bytes; the head runs in the target's dtype)."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in head.state_dict().items()
    }
    save_file(tensors, str(path / "head.safetensors"))
    config = {
        "format": FORMAT,
        "version": VERSION,
        "target": target,
        "target_check": asdict(check),
        "head": asdict(head.config),
        "training": training,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")


def _read_config(path: Path) -> tuple[dict, HeadConfig, TargetCheck]:
    config_file, weights_file = path / "config.json", path / "head.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path} is not an EAGLE head directory (needs config.json and head.safetensors)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if config.get("format") != FORMAT or config.get("version") != VERSION:
            raise ValueError(f"format {config.get('format')!r} version {config.get('version')!r}")
        head = HeadConfig(**{**config["head"], "feature_layers": tuple(config["head"].get("feature_layers", ()))})
        return config, head, TargetCheck(**config["target_check"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{config_file} is not a {FORMAT} v{VERSION} config: {err}") from err


def fits(path: str | Path, target_model: torch.nn.Module) -> bool:
    """Whether the head directory at `path` was made for this model (its config alone is read)."""
    try:
        _, _, check = _read_config(Path(path).expanduser())
    except ValueError:
        return False
    return check.mismatch(TargetCheck.of(target_model)) is None


def load_head(path: str | Path, target_model: torch.nn.Module | None = None) -> SavedHead:
    """Read a head directory; with target_model, refuse (ValueError) a head made for another model."""
    path = Path(path).expanduser()
    config, head_config, check = _read_config(path)
    if target_model is not None:
        problem = check.mismatch(TargetCheck.of(target_model))
        if problem:
            raise ValueError(
                f"EAGLE head {path} was trained for {config['target']!r}, not this target: {problem}; train one for "
                "this model with `metasd train-eagle --target ...`"
            )
    weights_file = path / "head.safetensors"
    try:
        tensors = load_file(str(weights_file))
        head = EagleHead(head_config, tensors["draft_vocab"])
        head.load_state_dict(tensors)
    except (SafetensorError, KeyError, RuntimeError, ValueError, OSError) as err:
        raise ValueError(f"{weights_file} does not hold this head's weights: {err}") from err
    return SavedHead(head=head.eval(), target=config["target"], check=check, training=config.get("training", {}))


def head_fingerprint(head: EagleHead) -> str:
    """SHA-256 of a head's weights rounded to bfloat16: which head another grew from (learned from traffic, or a
    later phase of training), the same whether the head was read in float16, float32 or bfloat16."""
    digest = hashlib.sha256()
    for name, tensor in sorted(head.state_dict().items()):
        value = tensor.detach().cpu()
        value = value.to(torch.bfloat16) if value.is_floating_point() else value
        digest.update(name.encode())
        digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
