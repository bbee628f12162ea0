"""The gRPC API (`kvserve/v1/kvserve.proto`) and its generated stubs (`python protos/generate.py`).
Imports nothing else of kvserve; used by deploy and the CLI's gRPC client."""
