"""The Ray Serve application: gRPC and OpenAI HTTP ingress, ServeConfig, `kvserve serve`.
The top layer: may import router, workers, kvcache, protos and the core."""
