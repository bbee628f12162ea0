"""The committed gRPC stubs match the proto (regenerating changes nothing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generate():
    spec = importlib.util.spec_from_file_location("kvserve_protos_generate",
                                                  ROOT / "protos" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    gen = _load_generate()
    for fresh in gen.generate(tmp_path):
        committed = ROOT / "protos" / fresh.name
        assert committed.exists(), f"{committed} missing: run python protos/generate.py"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run python protos/generate.py"
        )


def test_stubs_import_from_package() -> None:
    from kvserve.protos import kvserve_pb2, kvserve_pb2_grpc

    methods = {m.name for m in kvserve_pb2.DESCRIPTOR.services_by_name["KVServe"].methods}
    assert methods == {"Generate", "GenerateStream", "Chat", "ChatStream", "Tokenize",
                       "ListModels", "GetServerInfo", "DrainWorker", "MoveStream",
                       "LoadLoraAdapter", "UnloadLoraAdapter"}
    assert callable(kvserve_pb2_grpc.add_KVServeServicer_to_server)
    req = kvserve_pb2.GenerateRequest(prompt="hi", session_id="s")
    assert req.HasField("session_id") and not req.sampling.HasField("max_tokens")
