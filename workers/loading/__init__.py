"""Loading a model: GGUF and HF weights, model config, quant formats, tokenizer, chat template,
detokenizer. Imports only the kvserve core."""
