"""What the loader needs to know about GGUF files before and while it converts one.

transformers reads GGUF checkpoints itself (``from_pretrained(dir, gguf_file=...)``, with the
``gguf`` package), dequantizing every tensor; this module adds the small parts it does not:

- `read_gguf_architecture`: the file's ``general.architecture`` from its header, without
  parsing the (large) tokenizer arrays, so an unsupported file fails in milliseconds;
- `GGUF_ARCHITECTURES`: the GGUF architectures octavo converts (and the HF model_type each
  becomes);
- `fallback_chat_template`: a chat template for files that carry none (Gemma 3 GGUFs made from
  the base checkpoints do not; Gemma's template is the same for every Gemma 3 model).
"""

from __future__ import annotations

import struct
from pathlib import Path

# GGUF general.architecture -> the HF model_type transformers turns it into. Only these are
# converted: both are tested (tests/model/test_gguf_models.py); others transformers can read
# would need their own checks first.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "gemma3": "gemma3_text",
}

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format of a scalar (8 string, 9 array are variable length)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file octavo can read."""


def read_gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of a GGUF file (v2 or v3), read from its header alone."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != _MAGIC:
            raise GGUFFormatError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        version = struct.unpack("<I", head[4:])[0]
        if version not in (2, 3):
            raise GGUFFormatError(f"{str(path)!r}: unsupported GGUF version {version}")
        _tensor_count, kv_count = struct.unpack("<QQ", _read(f, 16, path))
        for _ in range(kv_count):
            key = _read_string(f, path)
            value_type = struct.unpack("<I", _read(f, 4, path))[0]
            if key == "general.architecture":
                if value_type != _STRING:
                    raise GGUFFormatError(f"{str(path)!r}: general.architecture is not a string")
                return _read_string(f, path)
            _skip_value(f, value_type, path)
    raise GGUFFormatError(f"{str(path)!r} has no general.architecture in its metadata")


def _read(f, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFFormatError(f"{str(path)!r}: truncated GGUF header")
    return data


def _read_string(f, path: Path) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8, path))
    return _read(f, n, path).decode("utf-8", errors="replace")


def _skip_value(f, value_type: int, path: Path) -> None:
    if value_type in _SCALAR_FORMATS:
        _read(f, struct.calcsize(_SCALAR_FORMATS[value_type]), path)
    elif value_type == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8, path))
        f.seek(n, 1)
    elif value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", _read(f, 12, path))
        if item_type in _SCALAR_FORMATS:
            f.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type, path)
    else:
        raise GGUFFormatError(f"{str(path)!r}: unknown GGUF metadata type {value_type}")


def check_supported(path: str | Path) -> str:
    """The HF model_type the GGUF at `path` converts to; a clear error if octavo cannot."""
    arch = read_gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r} has architecture {arch!r}; octavo converts GGUF files of "
            f"these architectures: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return GGUF_ARCHITECTURES[arch]


# Gemma 3's chat template, as in google/gemma-3-*-it tokenizer_config.json (text and images)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

# model_type -> (chat template when the file has none, extra end-of-turn token ids to stop at)
_FALLBACKS: dict[str, tuple[str, tuple[int, ...]]] = {
    # <end_of_turn> is 106 in every Gemma 3 vocabulary; HF's generation_config stops at [1, 106]
    "gemma3_text": (GEMMA3_CHAT_TEMPLATE, (106,)),
}


def fallback_chat_template(model_type: str) -> str | None:
    entry = _FALLBACKS.get(model_type)
    return entry[0] if entry else None


def extra_eos_token_ids(model_type: str) -> tuple[int, ...]:
    entry = _FALLBACKS.get(model_type)
    return entry[1] if entry else ()
