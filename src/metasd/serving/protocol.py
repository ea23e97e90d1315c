"""The OpenAI wire format the server accepts and answers in: request models, the error shape, the limits on what a
request may ask for, and the checks that refuse a request before it reaches the decoding thread."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

# OpenAI fields the decoder cannot honour: accepted only at these neutral values, rejected otherwise.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
}
MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256  # per stop string: held-back text and the per-round check stay small
MAX_BODY_BYTES = 2 << 20  # default --max-body-bytes: 2 MiB, far beyond any prompt that fits a context
HISTORY_SCOPES = ("shared", "per-key", "off")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def _error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


class _Request(BaseModel):
    """Fields both endpoints honour. Unknown fields pass (clients send many optional ones) unless in _NEUTRAL."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension, as in vLLM; 0 disables
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # int64, as OpenAI; torch rejects larger
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    metasd_policy: str | None = None
    metasd_drafters: str | list[str] | None = None

    @field_validator("temperature", "top_p", "top_k", "n", "stream", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI documents these as "number or null", and clients do send null."""
        return cls.model_fields[info.field_name].default if value is None else value

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or not all(stops) or max(map(len, stops), default=0) > MAX_STOP_CHARS:
            raise ApiError(
                400,
                f"stop must be a non-empty string of at most {MAX_STOP_CHARS} characters or a list "
                f"of at most {MAX_STOP} of them",
                "stop",
            )
        return stops

    def check(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"only n=1 is supported (one completion per request), got n={self.n}", "n")
        for name, value in (self.model_extra or {}).items():
            if name in _NEUTRAL and value not in _NEUTRAL[name]:
                raise ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


class CompletionRequest(_Request):
    """The body of /v1/completions (OpenAI's fields metasd serves; others are refused)."""

    prompt: str | list[int]  # raw text (no chat template) or token ids


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[_TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(_Request):
    """The body of /v1/chat/completions (OpenAI's fields metasd serves; others are refused)."""

    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


def _max_prompt_chars(tokenizer: Any, context: int) -> int:
    """More characters than this cannot fit in `context` tokens: no token stands for more characters than the
    longest string in the vocabulary (+1 for a space a decoder may insert), times 4 where a normalizer could
    compose characters (NFC turns up to 3 code points into 1). Computed once, so an over-long prompt is refused
    before the worker spends seconds tokenizing it."""
    longest = max(map(len, tokenizer.get_vocab()), default=1) + 1
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None
    return context * longest * (4 if normalizes else 1)


def _check_prompt_size(prompt: Any, chat: bool, max_chars: int, context: int) -> None:
    """Refuse, in the event loop, a prompt that surely exceeds the context: by token count for ids, by characters
    for text (the worker later checks the exact token count of what passes)."""
    if isinstance(prompt, list) and not chat:
        size, unit = len(prompt), "token ids"
        limit = context
    else:
        size = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        unit, limit = "characters", max_chars
    if chat and len(prompt) > context:  # a chat template marks every turn with at least one token
        size, unit, limit = len(prompt), "messages", context
    if size > limit:
        raise ApiError(
            400,
            f"this model's context is {context} tokens, and a prompt of {size} {unit} cannot fit in it",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )


_Body = TypeVar("_Body", bound=BaseModel)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 415 unless it is declared JSON (a browser sends text/plain and form types cross-site
    without a CORS preflight) and with 413 once it exceeds `limit` bytes: by its Content-Length before reading,
    and while reading (a chunked body has none)."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {media or 'none'!r} "
            "(with curl: -H 'Content-Type: application/json')",
            code="unsupported_media_type",
        )
    too_large = ApiError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def _parse(request: Request, schema: type[_Body], limit: int) -> _Body:
    """The body as a JSON object of `schema`; one readable 4xx otherwise."""
    raw = await _read_body(request, limit)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "missing":
            raise ApiError(400, f"missing required field {param!r}", param) from None
        raise ApiError(400, f"{param}: {first['msg']}", param) from None
