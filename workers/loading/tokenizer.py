"""Tokenizer for a GGUF file or an HF model directory, backed by HF `tokenizers`.

A GGUF carries no tokenizer.json, only llama.cpp-style metadata (`tokenizer.ggml.*`), so the
backend is rebuilt from the vocabulary, merges and token types; an HF directory's tokenizer.json
is used as-is. Either way encode/decode match what transformers produces for the same files,
except where transformers' GGUF loader drops a pre-tokenizer step the model was trained with
(SmolLM's digit split): there kvserve follows the model's published tokenizer, as llama.cpp does.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvserve.errors import InvalidRequestError, ModelLoadError
from kvserve.tools import prompt as tools_prompt
from kvserve.workers.loading.chat_template import render_chat, select_template
from kvserve.workers.loading.detokenizer import BytePieces, IncrementalDetokenizer, byte_alphabet

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids, plus the model's chat template and end-of-sequence ids."""

    def __init__(
        self,
        backend: Backend,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        special_tokens: dict[str, str],
        chat_templates: dict[str, str],
        source: str,
    ) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.vocab_size = vocab_size
        self.source = source  # the file or directory it was loaded from, for messages
        self.special_tokens = special_tokens  # bos_token/eos_token/... strings for templates
        self.chat_templates = chat_templates
        self.chat_template: str | None = chat_templates.get("default")
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        # Whatever the post-processor prepends is what the model expects in front of text.
        with_special = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
        self.add_bos = len(with_special) > len(plain) and with_special[:1] != plain[:1]
        if bos_token_id is None and self.add_bos:
            bos_token_id = with_special[0]
        self.bos_token_id = bos_token_id
        self._byte_pieces: BytePieces | None | bool = False  # False: not built yet

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def backend(self) -> Backend:
        """The underlying `tokenizers.Tokenizer` (for offsets, batch encoding, ...)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Ids past the vocabulary decode to nothing rather than failing a stream.
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError) as exc:
            raise InvalidRequestError(f"token ids must be non-negative integers ({exc})") from exc

    def byte_pieces(self) -> BytePieces | None:
        """Per-token bytes for the streaming detokenizer (None unless the decoder is plain
        ByteLevel); built once and shared by every stream of this tokenizer."""
        if self._byte_pieces is False:
            self._byte_pieces = BytePieces.build(self)
        return self._byte_pieces  # type: ignore[return-value]

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Control tokens (BOS/EOS/<|im_start|>, ...) that decode(skip_special_tokens=True) drops."""
        return token_id in self._special_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render messages with the model's template (`chat_template=` picks a named one)."""
        template = select_template(
            self.chat_templates, kwargs.pop("chat_template", None), kwargs.get("tools")
        )
        if template is None:
            raise InvalidRequestError(
                f"the model at {self.source} has no chat template, so chat messages cannot be "
                "formatted; send a plain prompt instead"
            )
        # tools and tool messages: as the template takes them, or kvserve's default tools
        # prompt where it has no tools section
        messages, tools = tools_prompt.render_inputs(template, messages, kwargs.pop("tools", None))
        if tools:
            kwargs["tools"] = tools
        text = render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )
        # The template writes BOS/role tokens itself, so nothing more is added (as transformers).
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(model_path: str) -> Tokenizer:
    """Load from a .gguf file or an HF directory (tokenizer.json + tokenizer_config.json)."""
    path = os.path.expanduser(model_path)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    return _load_gguf(path)


# ---------------------------------------------------------------------------------------------
# GGUF


# Scalar metadata value types of the GGUF format, as struct codes; 8 is string, 9 is array.
_GGUF_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# llama.cpp token types
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


class _MetadataReader:
    """Reads only a GGUF's key/value header: far quicker than a full reader (no tensor index)."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos = buf, path, 0
        self.endian = "<"

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        fmt = self.endian + fmt
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: GGUF metadata is truncated at byte {self.pos}")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self._unpack("Q")
        if self.pos + length > len(self.buf):
            raise ModelLoadError(f"{self.path}: GGUF string runs past the end of the file")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: GGUF string is not UTF-8 ({exc})") from exc

    def value(self, kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return self._unpack(_GGUF_SCALARS[kind])[0]
        if kind == _GGUF_STRING:
            return self.string()
        if kind == _GGUF_ARRAY:
            item_kind, count = self._unpack("IQ")
            if count > len(self.buf):  # every element takes at least a byte
                raise ModelLoadError(f"{self.path}: GGUF array length {count} is impossible")
            if item_kind in _GGUF_SCALARS:
                return list(self._unpack(f"{count}{_GGUF_SCALARS[item_kind]}"))
            return [self.value(item_kind) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}")

    def read(self) -> dict[str, Any]:
        if self.buf[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path}: not a GGUF file (starts with {self.buf[:4]!r})")
        self.pos = 4
        (version,) = self._unpack("I")
        if version > 0xFFFF:  # a big-endian file reads as a huge little-endian number
            self.endian = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version < 2:
            raise ModelLoadError(f"{self.path}: GGUF version {version} is too old (need 2+)")
        _n_tensors, n_kv = self._unpack("QQ")
        meta = {}
        for _ in range(n_kv):
            key = self.string()
            (kind,) = self._unpack("I")
            meta[key] = self.value(kind)
        return meta


def _read_gguf_metadata(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _MetadataReader(buf, path).read()
    except ValueError as exc:  # mmap of an empty file
        raise ModelLoadError(f"{path}: not a GGUF file ({exc})") from exc
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror or exc})") from exc


# Pre-tokenizer split regexes by `tokenizer.ggml.pre`; others use GPT-2's (ByteLevel's built-in).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM was trained with each numeric character split off (not only 0-9)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _byte_level_backend(
    tokens: list[str], merges: list[str] | None, pre: str | None, path: str
) -> Backend:
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        # Some converters store a token's raw text; the BPE model needs it in the byte alphabet.
        key = tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    backend = Backend(models.BPE(vocab=vocab, merges=_split_merges(merges or [], path)))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merges(merges: list[str], path: str) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"{path}: GGUF merge {merge!r} is not two tokens split by a space")
        pairs.append((left, right))
    return pairs


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """SentencePiece GGUFs list no merges; a piece's score ranks the merges that produce it."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for i, tok in enumerate(tokens):
        if types[i] != _NORMAL:
            continue
        splits = [
            (tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab
        ]
        splits.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((-scores[i], -len(left), -len(right), left, right) for left, right in splits)
    ranked.sort(key=lambda m: m[:3])  # stable, so equal scores keep vocabulary order
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(
    tokens: list[str],
    types: list[int],
    scores: list[float],
    merges: list[str] | None,
    unk_token: str | None,
    add_space_prefix: bool,
    path: str,
) -> Backend:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = _split_merges(merges, path) if merges else _merges_from_scores(tokens, types, scores)
    backend = Backend(
        models.BPE(
            vocab=vocab, merges=pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # undo the space the pre-tokenizer put in front of the text
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _gguf_list(meta: dict[str, Any], key: str, path: str, kind: type, length: int | None) -> list:
    value = meta.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise ModelLoadError(f"{path}: GGUF key {key} is not a list of {kind.__name__}")
    if length is not None and len(value) != length:
        raise ModelLoadError(f"{path}: GGUF key {key} has {len(value)} entries for {length} tokens")
    return value


def _load_gguf(path: str) -> Tokenizer:
    meta = _read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens = _gguf_list(meta, "tokenizer.ggml.tokens", path, str, None)
    if kind is None or not tokens:
        raise ModelLoadError(
            f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.model/tokens)"
        )
    n = len(tokens)
    types = _gguf_list(meta, "tokenizer.ggml.token_type", path, int, n) or [_NORMAL] * n
    merges = _gguf_list(meta, "tokenizer.ggml.merges", path, str, None) or None

    named: dict[str, int] = {}
    for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is None:
            continue
        if not isinstance(token_id, int) or not 0 <= token_id < n:
            raise ModelLoadError(
                f"{path}: tokenizer.ggml.{name}_token_id={token_id!r} is not a token id"
            )
        named[name] = token_id

    try:
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, merges, meta.get("tokenizer.ggml.pre"), path)
        elif kind == "llama":
            scores = _gguf_list(meta, "tokenizer.ggml.scores", path, float, n)
            backend = _sentencepiece_backend(
                tokens,
                types,
                scores or [-float(i) for i in range(n)],
                merges,
                tokens[named["unknown"]] if "unknown" in named else None,
                bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                path,
            )
        else:
            raise ModelLoadError(
                f"{path}: tokenizer.ggml.model={kind!r} is not supported (supported: gpt2, llama)"
            )
    except ModelLoadError:
        raise
    except Exception as exc:  # tokenizers raises plain Exceptions for inconsistent vocab/merges
        raise ModelLoadError(
            f"{path}: cannot build the tokenizer from GGUF metadata: {exc}"
        ) from exc

    # Control tokens (and the named ones) are whole, special tokens; user-defined ones are whole
    # but ordinary text. Without this they would be split into pieces by BPE.
    special = sorted({i for i, t in enumerate(types) if t == _CONTROL} | set(named.values()))
    backend.add_special_tokens(
        [_whole(tokens[i], True) for i in special if _in_vocab(backend, tokens[i], i)]
    )
    backend.add_tokens(
        [
            _whole(tok, False)
            for i, (tok, t) in enumerate(zip(tokens, types, strict=True))
            if t == _USER_DEFINED and _in_vocab(backend, tok, i)
        ]
    )

    # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and "bos" in named
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos" in named
    _set_template_processing(
        backend,
        tokens,
        named.get("bos") if add_bos else None,
        named.get("eos") if add_eos else None,
    )

    templates = {}
    for key, value in meta.items():
        if key == "tokenizer.chat_template" and isinstance(value, str):
            templates["default"] = value
        elif key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            templates[key.removeprefix("tokenizer.chat_template.")] = value
    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    return Tokenizer(
        backend,
        vocab_size=n,
        bos_token_id=named.get("bos"),
        eos_token_ids=[named[k] for k in ("eos", "eot", "eom") if k in named],
        special_tokens={names[k]: tokens[i] for k, i in named.items() if k in names},
        chat_templates=templates,
        source=path,
    )


def _whole(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _in_vocab(backend: Backend, token: str, token_id: int) -> bool:
    # A token whose text was respelled into the byte alphabet cannot be matched verbatim.
    return backend.token_to_id(token) == token_id


def _set_template_processing(
    backend: Backend, tokens: list[str], bos: int | None, eos: int | None
) -> None:
    single = ([f"{tokens[bos]}:0"] if bos is not None else []) + ["$A:0"]
    single += [f"{tokens[eos]}:0"] if eos is not None else []
    pair = single + ([f"{tokens[bos]}:1"] if bos is not None else []) + ["$B:1"]
    pair += [f"{tokens[eos]}:1"] if eos is not None else []
    specials = [(tokens[i], i) for i in (bos, eos) if i is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


# ---------------------------------------------------------------------------------------------
# HF directory


def _read_json(path: str, required: bool = False) -> dict[str, Any]:
    if not os.path.exists(path):
        if required:
            raise ModelLoadError(f"{path}: file not found")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc})") from exc


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as serialized AddedTokens.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_templates(folder: str, config: dict[str, Any]) -> dict[str, str]:
    """Templates as transformers finds them: .jinja files first, then tokenizer_config.json."""
    templates: dict[str, str] = {}
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        templates["default"] = _read_text(jinja_file)
    extra_dir = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                templates[name.removesuffix(".jinja")] = _read_text(os.path.join(extra_dir, name))
    if templates:
        return templates
    source = config.get("chat_template")
    if source is None:  # processors of multimodal models keep it in its own JSON file
        source = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        for entry in source:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ModelLoadError(
                    f"{os.path.join(folder, 'tokenizer_config.json')}: chat_template list entries "
                    "need string 'name' and 'template'"
                )
            templates[entry["name"]] = entry["template"]
    return templates


def _eos_ids_from(config: dict[str, Any], path: str) -> list[int]:
    value = config.get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(
            f"{path}: eos_token_id must be an int or a list of ints, got {value!r}"
        )
    return ids


def _load_hf_dir(folder: str) -> Tokenizer:
    tokenizer_file = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        hint = (
            "; only a SentencePiece tokenizer.model is there -- re-save the tokenizer with "
            "transformers to produce tokenizer.json"
            if os.path.exists(os.path.join(folder, "tokenizer.model"))
            else ""
        )
        raise ModelLoadError(
            f"{tokenizer_file}: file not found (kvserve needs tokenizer.json{hint})"
        )
    try:
        backend = Backend.from_file(tokenizer_file)
    except Exception as exc:  # tokenizers reports any parse problem as a bare Exception
        raise ModelLoadError(f"{tokenizer_file}: not a valid tokenizers file ({exc})") from exc

    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(folder, "special_tokens_map.json"))
    special_tokens = {}
    for name in _SPECIAL_NAMES:
        text = _token_text(config.get(name, special_map.get(name)))
        if text is not None:
            special_tokens[name] = text
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    extra_texts = [_token_text(v) for v in extra] if isinstance(extra, list) else []

    # Like transformers, the configured special tokens are special even when tokenizer.json
    # lists them only in the model vocabulary (so decode skips them and encode keeps them whole).
    already = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    to_mark = []
    for text in [*special_tokens.values(), *extra_texts]:
        token_id = backend.token_to_id(text) if text else None
        if token_id is not None and token_id not in already:
            to_mark.append(_whole(text, True))
            already.add(token_id)
    if to_mark:
        backend.add_special_tokens(to_mark)

    def token_id(name: str) -> int | None:
        text = special_tokens.get(name)
        return backend.token_to_id(text) if text is not None else None

    eos = token_id("eos_token")
    generation_file = os.path.join(folder, "generation_config.json")
    model_file = os.path.join(folder, "config.json")
    # generate() stops on generation_config's ids; config.json is what it falls back to.
    if os.path.isfile(generation_file):
        extra_eos = _eos_ids_from(_read_json(generation_file), generation_file)
    else:
        extra_eos = _eos_ids_from(_read_json(model_file), model_file)
    return Tokenizer(
        backend,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=token_id("bos_token"),
        eos_token_ids=([eos] if eos is not None else []) + extra_eos,
        special_tokens=special_tokens,
        chat_templates=_hf_chat_templates(folder, config),
        source=folder,
    )
