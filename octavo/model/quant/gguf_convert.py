"""A GGUF file's config and tokenizer as the small files of an HF directory (config.json,
generation_config.json, the tokenizer's files): written once per file into the cache, so that
the engine reads a GGUF model's architecture and tokenizer as it reads any other. No weights:
the loader reads those from the GGUF file itself (model/gguf_loader.py).

- the config is transformers' reading of the metadata (`AutoConfig.from_pretrained(...,
  gguf_file=...)`), plus what it leaves out that shapes the weights: Qwen2-MoE's expert sizes
  (from the expert tensors' shapes) and the head size (`attention.key_length`);
- the tokenizer, its special tokens and chat template are transformers' conversion of the
  file's tokenizer metadata; files without a chat template get their family's where it is
  fixed (Gemma 3: `fallback_chat_template`);
- the tokens that end a turn besides the file's EOS (Gemma's <end_of_turn>, ChatML's
  <|im_end|> and <|endoftext|>, Llama 3's <|eot_id|>...), as the models' own generation
  configs list them, are added to `eos_token_id` where the vocabulary has them.

`read_gguf_architecture` reads ``general.architecture`` from the header alone, so that a file
of an unsupported architecture fails in milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

from octavo.model.quant.gguf_file import GGUFFile, GGUFFormatError
from octavo.model.quant.gguf_tensors import ARCHITECTURES

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format of a scalar (8 string, 9 array are variable length)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# model_type -> token texts that end a turn besides the file's EOS (the models' generation
# configs list them as EOS ids)
END_OF_TURN: dict[str, tuple[str, ...]] = {
    "llama": ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    "qwen2": ("<|im_end|>", "<|endoftext|>"),
    "qwen2_moe": ("<|im_end|>", "<|endoftext|>"),
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "phi3": ("<|end|>", "<|endoftext|>"),
    "gemma2": ("<end_of_turn>",),
    "gemma3_text": ("<end_of_turn>",),
}


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
    """The HF model_type the GGUF at `path` runs as; a clear error if octavo cannot."""
    arch = read_gguf_architecture(path)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r} has architecture {arch!r}; octavo runs GGUF files of "
            f"these architectures: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[arch]


def hf_config(gguf_path: Path, gf: GGUFFile) -> dict[str, Any]:
    """config.json's contents for the GGUF file (see the module docstring)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    d = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        d.pop(key, None)
    model_type = d["model_type"]
    key_length = gf.arch_get("attention.key_length")
    if key_length:
        d["head_dim"] = int(key_length)
    if model_type == "qwen2_moe":  # transformers keeps its defaults; the tensors say
        experts = gf.tensors.get("blk.0.ffn_gate_exps.weight")
        shared = gf.tensors.get("blk.0.ffn_gate_shexp.weight")
        if experts is not None:
            d["moe_intermediate_size"] = experts.shape[1]
        if shared is not None:
            d["shared_expert_intermediate_size"] = shared.shape[0]
    d["dtype"] = "float32"
    d["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")]
    return d


def write_model_dir(gguf_path: Path, out_dir: Path, record: dict[str, Any]) -> Path:
    """The GGUF file's config and tokenizer files (and `record`, as gguf.json) in `out_dir`,
    written to a temporary directory and renamed into place."""
    from transformers import AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        with GGUFFile(gguf_path) as gf:
            config = hf_config(gguf_path, gf)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model_type = config["model_type"]
        if not tokenizer.chat_template:
            tokenizer.chat_template = fallback_chat_template(model_type)
        eos = config.get("eos_token_id")
        eos = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        vocab = tokenizer.get_vocab()
        extra = [vocab[t] for t in END_OF_TURN.get(model_type, ()) if t in vocab]
        eos += [t for t in dict.fromkeys(extra) if t not in eos]
        if eos:
            config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if config.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(str(tmp))
        (tmp / GGUF_RECORD).write_text(json.dumps(record, indent=2))
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


GGUF_RECORD = "gguf.json"  # in a GGUF model's directory: the file and how "auto" runs it


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

# model_type -> the chat template of files that carry none
_CHAT_TEMPLATES: dict[str, str] = {"gemma3_text": GEMMA3_CHAT_TEMPLATE}


def fallback_chat_template(model_type: str) -> str | None:
    return _CHAT_TEMPLATES.get(model_type)
