"""Models by Hub name, fetched by huggingface_hub from a local stand-in for the Hub.

tests/hub_server.py answers huggingface_hub's model-info and file routes on a loopback port, so
these tests run real downloads (ranges, resumes, the cache's layout, offline starts) without
network; huggingface_hub's settings (endpoint, cache, offline mode) point at it per test.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading

import pytest
from hub_server import FakeHub, Hold, folder_files
from tiny_models import make_tiny_hf_model

from kvserve import LLM, SamplingParams
from kvserve.errors import ModelLoadError
from kvserve.hub import HubModel, parse_hub_id
from kvserve.models import resolve_model, served_name

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The capital of France is"
SHARD = "model-00001-of-00003.safetensors"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama in three safetensors shards with an index, plus files kvserve must
    not fetch (a README, a duplicate .bin and a GGUF)."""
    path = tmp_path_factory.mktemp("hub") / "tiny"
    make_tiny_hf_model(path, "llama", seed=3, max_shard_size="10MB")
    assert os.path.isfile(path / "model.safetensors.index.json")
    return str(path)


@pytest.fixture(scope="module")
def tiny_files(tiny_dir) -> dict[str, bytes]:
    files = folder_files(tiny_dir)
    files |= {"README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 4096,
              "other.gguf": b"GGUF" + b"\0" * 64}
    return files


@pytest.fixture(scope="module")
def reference(tiny_dir) -> list[int]:
    return LLM(tiny_dir, kv_cache_tokens=512, num_threads=1).generate(PROMPT, GREEDY)[0].token_ids


def _point_at(monkeypatch, url: str, home: str, offline: bool = False) -> None:
    """huggingface_hub reads these settings from the environment at import: set them here."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", home)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(home, "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", os.path.join(home, "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub() as h:
        _point_at(monkeypatch, h.url, str(tmp_path / "hf"))
        yield h


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def _fetched(h: FakeHub) -> set[str]:
    return {p.rsplit("/", 1)[1] for m, p, _ in h.requests if m == "GET" and "/resolve/" in p}


# ---- names ------------------------------------------------------------------------------------


def test_hub_names_parse(tmp_path, monkeypatch):
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubModel("Qwen/Qwen3-0.6B")
    assert parse_hub_id("org/name@v1.0") == HubModel("org/name", "v1.0")
    assert parse_hub_id("org/name@refs/pr/3") == HubModel("org/name", "refs/pr/3")
    assert parse_hub_id("org/m-GGUF:sub/m.Q4_K_M.gguf@" + "a" * 40) == HubModel(
        "org/m-GGUF", "a" * 40, "sub/m.Q4_K_M.gguf")
    assert str(parse_hub_id("org/m:m.gguf@dev")) == "org/m:m.gguf@dev"
    for path in ("/abs/model", "./org/name", "~/m.gguf", "model.gguf", "dir/model.gguf",
                 "a/b/c", "org/name:notes.txt"):
        assert parse_hub_id(path) is None, path
    with pytest.raises(ModelLoadError, match="not a valid Hub repository id"):
        parse_hub_id("org/na--me")
    assert served_name("org/name@v1") == "org/name"
    assert served_name("org/m-GGUF:m.Q4_K_M.gguf") == "m.Q4_K_M"
    # a relative directory that exists is a path, even when it reads like a Hub name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_model("org/name") == "org/name"


# ---- fetching and running -----------------------------------------------------------------


def test_model_by_name_generates_and_starts_offline(hub, tiny_files, reference, monkeypatch):
    sha = hub.add_commit("org/tiny", tiny_files)
    llm = LLM("org/tiny", kv_cache_tokens=512, num_threads=1)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == reference
    assert llm.engine.model_path.endswith(os.path.join("models--org--tiny", "snapshots", sha))
    # only what the engine reads: no README, no duplicate .bin, no GGUF
    assert _fetched(hub) == {f for f in tiny_files
                             if f.endswith((".json", ".safetensors", ".jinja"))}
    with open(os.path.join(llm.engine.model_path, "..", "..", "refs", "main")) as f:
        assert f.read() == sha  # as huggingface_hub keeps a branch's commit
    # a full cache starts with no network at all
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(hub.requests)
    assert resolve_model("org/tiny") == llm.engine.model_path
    assert len(hub.requests) == n


def test_tokenizer_only_fetches_no_weights(hub, tiny_files, tiny_dir):
    from kvserve.workers.loading.tokenizer import load_tokenizer

    hub.add_commit("org/tiny", tiny_files)
    path = resolve_model("org/tiny", tokenizer_only=True)
    assert not any(f.endswith((".safetensors", ".bin")) for f in _fetched(hub))
    assert "tokenizer.json" in _fetched(hub)
    text = "Hello, world! 123"
    assert load_tokenizer(path).encode(text) == load_tokenizer(tiny_dir).encode(text)
    msgs = [{"role": "user", "content": "Hi"}]
    assert (load_tokenizer(path).apply_chat_template(msgs, tokenize=False)
            == load_tokenizer(tiny_dir).apply_chat_template(msgs, tokenize=False))


def test_revisions_branch_tag_and_commit(hub, tiny_files):
    old = hub.add_commit("org/tiny", tiny_files, refs=("main", "v1"))
    new = hub.add_commit("org/tiny", {**tiny_files, "config.json": tiny_files["config.json"]
                                      + b"\n"}, refs=("main",))
    assert old != new
    assert resolve_model("org/tiny").endswith(new)
    assert resolve_model("org/tiny@v1").endswith(old)
    # a commit hash in the cache is used without asking the Hub
    n = len(hub.requests)
    assert resolve_model(f"org/tiny@{old}").endswith(old)
    assert len(hub.requests) == n
    with pytest.raises(ModelLoadError, match="has no revision 'v9'") as e:
        resolve_model("org/tiny@v9")
    assert "\n" not in str(e.value)


def test_clear_errors(hub, tiny_files, monkeypatch):
    hub.add_commit("org/tiny", tiny_files)
    hub.add_commit("org/gated", tiny_files, gated=True)
    cases = [
        ("org/nothing", "no model repository 'org/nothing' on the Hub; if it is private, set "
                        "HF_TOKEN"),
        ("org/tiny:missing.gguf", "the repository has no file 'missing.gguf' at "),
        ("org/gated", "the repository is gated: accept its terms"),
    ]
    for name, message in cases:
        with pytest.raises(ModelLoadError) as e:
            resolve_model(name)
        assert message in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    assert "its GGUF files: other.gguf" in _error("org/tiny:missing.gguf")
    # the token opens the gated repository
    hub.token = "hf_test"
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert os.path.isdir(resolve_model("org/gated"))


def _error(name: str, **kw) -> str:
    with pytest.raises(ModelLoadError) as e:
        resolve_model(name, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_offline_miss_and_unreachable_hub(hub, tiny_files, monkeypatch, tmp_path):
    from huggingface_hub import constants

    hub.add_commit("org/tiny", tiny_files)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    msg = _error("org/tiny")
    assert "not in the Hugging Face cache at" in msg and "HF_HUB_OFFLINE=1" in msg
    assert hub.requests == []
    # a closed port: the Hub cannot be reached and nothing is cached
    _point_at(monkeypatch, f"http://127.0.0.1:{_closed_port()}", str(tmp_path / "hf"))
    msg = _error("org/tiny")
    assert "cannot reach the Hugging Face Hub at http://127.0.0.1:" in msg
    assert "not in the cache" in msg
    # once cached, a branch name starts from the cache while the Hub is unreachable
    _point_at(monkeypatch, hub.url, str(tmp_path / "hf"))
    path = resolve_model("org/tiny")
    _point_at(monkeypatch, f"http://127.0.0.1:{_closed_port()}", str(tmp_path / "hf"))
    assert resolve_model("org/tiny") == path
    # an incomplete copy says what it lacks
    os.remove(os.path.join(path, SHARD))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert f"lacks {SHARD}" in _error("org/tiny")


def test_cli_prints_one_line(hub, capsys):
    import sys

    from kvserve.cli import main

    assert main(["generate", "--model", "org/nothing", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: org/nothing: no model repository") and "\n" not in err
    # `kvserve serve` finds out before it starts Ray
    ray_loaded = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    assert main(["serve", "--model", "org/nothing@v2", "--gpus-per-worker", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: org/nothing@v2: no model repository") and "\n" not in err
    assert ray_loaded == ("ray" in sys.modules and sys.modules["ray"].is_initialized())


def test_serve_stopped_while_the_tokenizer_downloads(hub, tiny_files, tmp_path):
    """SIGTERM while `kvserve serve` fetches the tokenizer (the download held mid-file): it
    stops at once with status 0, nothing else started, not waiting for the transfer."""
    import signal
    import subprocess
    import sys

    hub.add_commit("org/tiny", tiny_files)
    hold = hub.holds["tokenizer.json"] = Hold(at=len(tiny_files["tokenizer.json"]) // 2)
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", "org/tiny",
         "--gpus-per-worker", "0", "--http-port", str(_closed_port()),
         "--grpc-port", str(_closed_port()), "--metrics-port", "0", "--dashboard-port", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert hold.reached.wait(120), "the tokenizer's download never started"
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)  # the hold is still on: it must not wait for it
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after SIGTERM; its threads:\n{_stacks(proc.pid)}")
    finally:
        hold.release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert out.rstrip().endswith("kvserve: stopped") and "starting Ray" not in out, out


def _stacks(pid: int) -> str:
    """The Python stacks of process `pid` (py-spy, installed with the test extras)."""
    import shutil
    import subprocess
    import sys

    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=30)
        return r.stdout + r.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(py-spy: {e})"


# ---- GGUF ---------------------------------------------------------------------------------


def test_gguf_file_by_name_and_its_header(hub, smol_path, smol_llm):
    from kvserve.workers.loading.tokenizer import load_tokenizer

    with open(smol_path, "rb") as f:
        data = f.read()
    hub.add_commit("org/smol-GGUF", {"smol.Q4_1.gguf": data, "other.Q8_0.gguf": b"GGUF"})
    # the front end: only the metadata header, by range requests
    header = resolve_model("org/smol-GGUF:smol.Q4_1.gguf", tokenizer_only=True)
    assert os.path.getsize(header) < len(data) // 10
    assert all(r is not None for r in hub.file_gets("smol.Q4_1.gguf"))
    tok, ref = load_tokenizer(header), smol_llm.tokenizer
    text = "Paris is the capital of France; 1234 €."
    assert tok.encode(text) == ref.encode(text)
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(
        msgs, tokenize=False)
    # the worker: the whole file, and only that one
    path = resolve_model("org/smol-GGUF:smol.Q4_1.gguf")
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest()
    assert _fetched(hub) == {"smol.Q4_1.gguf"}
    assert path.endswith(os.path.join("snapshots", hub.repos["org/smol-GGUF"].refs["main"],
                                      "smol.Q4_1.gguf"))


# ---- progress and resuming -------------------------------------------------------------------


def test_download_progress_counts_real_bytes(hub, tiny_files):
    hub.add_commit("org/tiny", tiny_files)
    total = sum(len(d) for f, d in tiny_files.items() if f.endswith(".safetensors"))
    hold = hub.holds[SHARD] = Hold(at=len(tiny_files[SHARD]) // 2)
    seen = []
    mid = threading.Event()

    def report(p) -> None:
        seen.append(p)
        if p.done_bytes >= hold.at and p.files_done < p.files_total:
            mid.set()

    t = threading.Thread(target=lambda: seen.append(resolve_model("org/tiny", progress=report)))
    t.start()
    try:
        assert hold.reached.wait(120)
        assert mid.wait(120)  # polled from the cache while the transfer is held half-way
    finally:
        hold.release.set()
        t.join(120)
    path = seen.pop()
    assert os.path.isdir(path)
    assert all(p.total_bytes == total and p.files_total == 3 for p in seen)
    held = [p for p in seen if p.files_done < 3 and p.done_bytes >= hold.at]
    assert held and all(p.done_bytes < total for p in held)
    assert [p.done_bytes for p in seen] == sorted(p.done_bytes for p in seen)
    assert seen[-1].done_bytes == total and seen[-1].files_done == 3
    assert re.fullmatch(r"downloading org/tiny: \S+ \S+ of 24\.\d MiB \(\d+%, \d/3 files\)",
                        held[0].state())


def test_broken_transfer_resumes_from_where_it_stopped(hub, tiny_files):
    hub.add_commit("org/tiny", tiny_files)
    # cut near the end: huggingface_hub keeps what it wrote (it reads 10 MB chunks) and asks
    # for the rest only
    at = len(tiny_files[SHARD]) - (256 << 10)
    hub.holds[SHARD] = Hold(at=at, cut=True)
    path = resolve_model("org/tiny")
    first, second = hub.file_gets(SHARD)
    assert first is None and 0 < int(re.fullmatch(r"bytes=(\d+)-", second)[1]) <= at
    with open(os.path.join(path, SHARD), "rb") as f:
        assert f.read() == tiny_files[SHARD]


def test_worker_reports_the_download_in_its_state(hub, tiny_files):
    from kvserve.workers.worker_actor import WorkerActor

    hub.add_commit("org/tiny", tiny_files)
    hold = hub.holds[SHARD] = Hold(at=len(tiny_files[SHARD]) // 2)
    states: list[str] = []
    downloading = threading.Event()

    class Reporter:  # the router's worker_state, as the actor calls it
        class worker_state:  # noqa: N801
            @staticmethod
            def remote(worker_id, incarnation, state, load_s) -> None:
                states.append(state)
                if state.startswith("downloading") and "3/3" not in state:
                    downloading.set()

    box = []
    engine = {"num_threads": 1, "kv_cache_tokens": 512, "model": "org/tiny"}
    t = threading.Thread(target=lambda: box.append(WorkerActor("worker-0", engine,
                                                               reporter=Reporter())))
    t.start()
    try:
        assert hold.reached.wait(120) and downloading.wait(120)
    finally:
        hold.release.set()
        t.join(300)
    (worker,) = box
    try:
        first = states.index(next(s for s in states if s.startswith("downloading org/tiny: ")))
        assert states[-1] == "ready" and "loading" in states[first:]
        assert any("(100%, 3/3 files)" in s for s in states)
        assert os.path.join("models--org--tiny", "snapshots") in worker.info()["model_path"]
    finally:
        worker.engine.shutdown()


def test_lora_adapter_by_hub_id(hub, tiny_files, tiny_dir, monkeypatch):
    """A LoRA adapter named by Hub id: its two files fetched (nothing else in the repository),
    then found in the cache offline; a repository that is no adapter is refused clearly."""
    from lora_adapters import write_adapter

    from kvserve.errors import AdapterError
    from kvserve.models import resolve_adapter

    local = write_adapter(os.path.join(tiny_dir, "..", "lora"), 2, 64, 64, 32, 128, 4, seed=1)
    files = folder_files(local) | {"README.md": b"# adapter\n"}
    sha = hub.add_commit("org/tiny-lora", files)
    llm = LLM(tiny_dir, kv_cache_tokens=512, num_threads=1, enable_lora=True)
    assert llm.load_lora("hub", "org/tiny-lora")["rank"] == 4
    path = resolve_adapter("org/tiny-lora")
    assert path.endswith(os.path.join("models--org--tiny-lora", "snapshots", sha))
    assert _fetched(hub) >= {"adapter_config.json", "adapter_model.safetensors"}
    assert "README.md" not in _fetched(hub)
    assert llm.generate(PROMPT, GREEDY, lora="hub")[0].token_ids != llm.generate(
        PROMPT, GREEDY)[0].token_ids
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(hub.requests)
    assert resolve_adapter("org/tiny-lora") == path and len(hub.requests) == n
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.add_commit("org/tiny", tiny_files)
    with pytest.raises(AdapterError, match="not a PEFT LoRA adapter repository"):
        resolve_adapter("org/tiny")
