"""Tokenizer, chat template and incremental detokenizer, checked against transformers."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil

import gguf
import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from kvserve.errors import InvalidRequestError, ModelLoadError
from kvserve.models import default_model
from kvserve.workers.loading.detokenizer import byte_alphabet
from kvserve.workers.loading.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces  ",
    "whitespace   runs\t\ttabs\n\n\nnewlines \r\n crlf",
    "héllo wörld, naïve café résumé",
    "你好，世界！日本語のテキスト、한국어 텍스트",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 keycap 1️⃣",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "not quite special <|im_start |> <im_end>",
    "numbers 1234567890 3.14159 2024-01-01",
    "I'm sure you'll see they've it's",
    "\x00\x1f control \u200b zero-width \ufffd replacement",
]

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the 🐔 cross the road?"},
        {"role": "user", "content": "Why? 你好"},
    ],
    [
        {"role": "system", "content": "  spaced  \n"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model()


@pytest.fixture(scope="module")
def tok(gguf_path: str) -> Tokenizer:
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path: str):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )


@pytest.fixture(scope="module")
def published(gguf_path: str):
    """transformers with SmolLM2's published pre-tokenizer (its tokenizer.json: each numeric
    character split off, then GPT-2's byte-level split), which llama.cpp's "smollm" type also
    applies. transformers' GGUF loader leaves out the digit split; for ASCII digits that makes
    no difference (the vocabulary merges no digit), for other numerics it does (the test below)."""
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return ref


@pytest.fixture(scope="module")
def hf_dir(ref, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    ref.save_pretrained(folder)
    return str(folder)


# --- encode / decode ------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, ref, text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_encode_matches_transformers_on_random_text(tok: Tokenizer, published, text: str) -> None:
    assert tok.encode(text) == published.encode(text)


def test_non_ascii_numerals_are_split_off_as_the_model_was_trained(tok, ref, published) -> None:
    """Where transformers' GGUF loader departs from the published tokenizer (a space before
    a numeric character other than 0-9), kvserve follows the published one."""
    for text in (" ¼", "x ³ y", " ٣"):
        assert tok.encode(text) == published.encode(text) != ref.encode(text), text
    assert [tok.id_to_token(i) for i in tok.encode(" ¼")] == ["Ġ", "Â¼"]


def test_gguf_metadata(tok: Tokenizer, ref) -> None:
    assert tok.vocab_size == 49152 == len(ref)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2] and tok.eos_token_id == 2
    assert tok.add_bos is False and tok.encode("hi")[0] != 1
    assert tok.special_token_ids == {i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert tok.is_special(2) and not tok.is_special(tok.encode("hello")[0])
    assert tok.id_to_token(2) == "<|im_end|>" and tok.token_to_id("<|im_start|>") == 1
    assert tok.encode("<|im_start|>") == [1]  # special text stays one token
    assert tok.chat_template == ref.chat_template


def test_pickles_for_remote_workers(tok: Tokenizer) -> None:
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode(TEXTS[6]) == tok.encode(TEXTS[6])
    assert copy.apply_chat_template(CHATS[0]) == tok.apply_chat_template(CHATS[0])


# --- chat templates -------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(tok, ref, messages, add_generation_prompt) -> None:
    expected = ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    )
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == ref.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


# Exercises the environment: tojson without HTML escaping, trim/lstrip blocks, namespace,
# loop controls, the generation tag, template kwargs and the special-token variables.
ENV_TEMPLATE = """\
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% generation %}{{ bos_token }}{{ m | tojson }}{% endgeneration %}
{% endfor %}
{{ ns.n }}|{{ eos_token }}|{{ tools | tojson(indent=2) }}|{{ extra }}|{{ add_generation_prompt }}
"""


def test_template_environment_matches_transformers(tok: Tokenizer, ref) -> None:
    messages = [
        {"role": "user", "content": "<b>&'é😀\"</b>"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "<x>"}}}]
    kwargs = {"chat_template": ENV_TEMPLATE, "tools": tools, "extra": "E"}
    expected = ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert tok.apply_chat_template(messages, **kwargs) == expected


def test_strftime_now_available(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CHATS[0], chat_template="{{ strftime_now('%Y') }}")
    assert text.isdigit() and len(text) == 4


def test_content_parts_are_joined_for_string_templates(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert as_parts == tok.apply_chat_template([{"role": "user", "content": "Hello\nworld"}])


def test_content_parts_kept_for_templates_that_iterate_them(tok: Tokenizer) -> None:
    template = (
        "{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}P:{{ p.text }};{% endfor %}{% endif %}{% endfor %}"
    )
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], chat_template=template)
    assert text == "P:a;P:b;"


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "messages[0] must be an object"),
        ([{"content": "x"}], "'role'"),
        ([{"role": "user"}], "needs 'content'"),
        ([{"role": "user", "content": 3}], "string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "only text parts",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "string 'text'"),
    ],
)
def test_bad_messages_rejected(tok: Tokenizer, messages, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(fragment)):
        tok.apply_chat_template(messages)


def test_template_errors_become_invalid_request(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tok.apply_chat_template(
            CHATS[0], chat_template="{{ raise_exception('roles must alternate') }}"
        )
    with pytest.raises(InvalidRequestError, match="unknown chat template"):
        tok.apply_chat_template(CHATS[0], chat_template="tool_use")


def test_assistant_tool_call_without_content_is_allowed(tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
    ]
    text = tok.apply_chat_template(messages, chat_template="{{ messages[1].tool_calls | tojson }}")
    assert text == '[{"name": "f"}]'


# --- incremental detokenizer ----------------------------------------------------------------


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


STREAM_TEXT = "Emoji 😀👍🏽👨‍👩‍👧 CJK 你好世界、日本語 accents café — done."


@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_multibyte_never_emits_partial_characters(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(STREAM_TEXT)
    # Make sure the sample really splits characters across tokens.
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(len(ids)))
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == STREAM_TEXT


def test_stream_with_prompt_and_special_tokens(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(CHATS[0], tokenize=True)
    generated = tok.encode(STREAM_TEXT) + [2]  # ends with <|im_end|>
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
        text = "".join(_stream(detok, generated))
        assert text == tok.decode(generated, skip_special_tokens=skip)
    assert text.endswith("<|im_end|>")


def test_stream_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(STREAM_TEXT * 40)
    longest = 0
    decode = Tokenizer.decode

    def recording_decode(self, token_ids, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(token_ids))
        return decode(self, token_ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", recording_decode)
    detok = IncrementalDetokenizer(tok, prompt_ids=list(range(100, 300)))
    text = "".join(_stream(detok, ids))
    monkeypatch.undo()
    assert text == tok.decode(ids)
    assert longest <= 12, f"a step decoded {longest} ids; the window should not grow with length"


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans(), chunk=st.integers(min_value=1, max_value=4))
def test_stream_random_ids(tok: Tokenizer, data, skip: bool, chunk: int) -> None:
    # Mix arbitrary ids (specials, ids past the vocabulary) with runs of a multi-byte text's ids,
    # so that many sequences split characters across tokens yet still decode cleanly.
    text_ids = tok.encode(STREAM_TEXT)
    run = st.tuples(st.integers(0, len(text_ids) - 1), st.integers(1, 8)).map(
        lambda r: text_ids[r[0] : r[0] + r[1]]
    )
    single = st.integers(min_value=0, max_value=tok.vocab_size + 8).map(lambda i: [i])
    pieces = data.draw(st.lists(st.one_of(single, run), max_size=8))
    ids = [i for piece in pieces for i in piece]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = _stream(detok, ids, chunk)
    full = tok.decode(ids, skip_special_tokens=skip)
    if "\ufffd" not in full:
        assert "".join(deltas) == full
        assert not any("\ufffd" in d for d in deltas)


# --- HF directory -----------------------------------------------------------------------------


def test_hf_directory_matches_transformers(hf_dir: str, tok: Tokenizer, ref) -> None:
    hf = load_tokenizer(hf_dir)
    for text in TEXTS:
        assert hf.encode(text) == ref.encode(text) == tok.encode(text)
    assert hf.decode(hf.encode(TEXTS[8])) == ref.decode(
        ref.encode(TEXTS[8]), skip_special_tokens=True
    )
    for messages in CHATS:
        assert hf.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert (hf.bos_token_id, hf.eos_token_ids, hf.add_bos) == (1, [2], False)
    assert hf.vocab_size == tok.vocab_size and hf.special_token_ids == tok.special_token_ids


def test_hf_directory_configs(hf_dir: str, tmp_path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(hf_dir, folder)
    os.remove(folder / "chat_template.jinja")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = load_tokenizer(str(folder))
    assert hf.eos_token_ids == [2, 0]
    assert hf.apply_chat_template(CHATS[0]) == "DHi there"
    assert hf.apply_chat_template(CHATS[0], tools=[{"name": "f"}]) == "T1"
    assert hf.apply_chat_template(CHATS[0], chat_template="default") == "DHi there"

    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        load_tokenizer(str(folder)).apply_chat_template(CHATS[0])


# --- SentencePiece ('llama') GGUF vocabularies ----------------------------------------------


def _write_sentencepiece_gguf(path: str, with_merges: bool) -> None:
    """A small Llama-style vocabulary: specials, 256 byte tokens, pieces ranked by score."""
    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "She sells sea shells by the sea shore; hello there!",
        "Tokenizers split text into pieces and map the pieces to ids.",
    ]
    trainer = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer.train_from_iterator(
        sentences * 10, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    )
    model = json.loads(trainer.to_str())["model"]
    rank = {"".join(m): r for r, m in enumerate(model["merges"])}
    pieces = sorted((i, t) for t, i in model["vocab"].items() if t not in ("<unk>", "<s>", "</s>"))
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        *(t for _, t in pieces),
    ]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(rank.get(t, 1000 + i)) for i, t in pieces])
    if with_merges:
        writer.add_token_merges([" ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m.content }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("with_merges", [False, True])
def test_sentencepiece_gguf_matches_transformers(tmp_path, with_merges: bool) -> None:
    path = str(tmp_path / "spm.gguf")
    _write_sentencepiece_gguf(path, with_merges)
    spm = load_tokenizer(path)
    spm_ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert spm.add_bos and spm.bos_token_id == 1
    for text in [
        "The quick brown fox",
        " leading",
        "sea  shells\nshore",
        "café 😀",
        "<s>x</s>",
        "",
    ]:
        ids = spm.encode(text)
        assert ids == spm_ref.encode(text)
        for skip in (True, False):
            assert spm.decode(ids, skip_special_tokens=skip) == spm_ref.decode(
                ids, skip_special_tokens=skip
            )
    messages = [{"role": "user", "content": "hi"}]
    assert spm.apply_chat_template(messages) == spm_ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )

    # Streaming after a prompt keeps the space SentencePiece puts before the first new word.
    prompt, generated = (
        spm.encode("hello there"),
        spm.encode("the 😀 fox", add_special_tokens=False),
    )
    detok = IncrementalDetokenizer(spm, prompt_ids=prompt)
    deltas = _stream(detok, generated)
    assert "".join(deltas) == " the 😀 fox" and not any("\ufffd" in d for d in deltas)
    alone = IncrementalDetokenizer(spm)
    assert "".join(_stream(alone, generated)) == spm.decode(generated) == "the 😀 fox"


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp("spm") / "spm.gguf")
    _write_sentencepiece_gguf(path, with_merges=False)
    return load_tokenizer(path)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans())
def test_sentencepiece_stream_random_ids(spm: Tokenizer, data, skip: bool) -> None:
    # Bias towards the ids that make SentencePiece streaming hard: a bare "▁" (its space is
    # stripped only at the start), specials, byte-fallback pieces and ids past the vocabulary.
    tricky = [spm.token_to_id("\u2581"), 0, 1, 2, 0x0A + 3, 0xE4 + 3, 0xBD + 3, 0xA0 + 3]
    any_id = st.integers(min_value=0, max_value=spm.vocab_size + 4)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(tricky), any_id), max_size=16))
    deltas = _stream(IncrementalDetokenizer(spm, skip_special_tokens=skip), ids)
    full = spm.decode(ids, skip_special_tokens=skip)
    if "\ufffd" not in full:
        assert "".join(deltas) == full
        assert not any("\ufffd" in d for d in deltas)


# --- load errors ----------------------------------------------------------------------------


def test_missing_paths(tmp_path) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load_tokenizer(missing)
    with pytest.raises(ModelLoadError, match="tokenizer.json: file not found"):
        load_tokenizer(str(tmp_path))


def test_corrupt_hf_files(hf_dir: str, tmp_path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(hf_dir, folder)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(str(folder))
    (folder / "tokenizer.json").write_text('{"truncated": ')
    with pytest.raises(ModelLoadError, match="tokenizer.json: not a valid tokenizers file"):
        load_tokenizer(str(folder))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(str(folder))


def test_corrupt_gguf_files(gguf_path: str, tmp_path) -> None:
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelLoadError, match="text.gguf: not a GGUF file"):
        load_tokenizer(str(not_gguf))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf"):
        load_tokenizer(str(empty))
    truncated = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        truncated.write_bytes(f.read(300_000))  # ends inside the token list
    with pytest.raises(ModelLoadError, match="cut.gguf: GGUF .*(truncated|past the end)"):
        load_tokenizer(str(truncated))
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(bare), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="bare.gguf: no tokenizer"):
        load_tokenizer(str(bare))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans(), chunk=st.integers(min_value=1, max_value=3))
def test_byte_level_stream_matches_decode_even_when_broken(tok: Tokenizer, data, skip: bool,
                                                           chunk: int) -> None:
    # The byte-level fast path: deltas join to exactly what decode gives, stray bytes
    # (U+FFFD) included; single bytes of multi-byte characters make many of those.
    assert tok.byte_pieces() is not None
    alphabet = byte_alphabet()
    byte_ids = [tok.token_to_id(alphabet[b]) for b in (0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x98, 0x80)]
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_ids), st.integers(0, tok.vocab_size + 4)),
                             max_size=12))
    deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
